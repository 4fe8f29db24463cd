"""Llama-3.1-8B-Instruct (GQA 32/8, llama3 RoPE scaling, 128k context) on 8x A100-80GB."""

from longspec_jax.config import ModelConfig, RopeScaling
from train.config import TrainConfig
from train.configs._paper import paper_stages

MODEL = ModelConfig(
    model_type="llama",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling=RopeScaling(
        kind="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
    ),
    max_position_embeddings=131072,
    bos_token_id=128000,
    eos_token_ids=(128001, 128008, 128009),
)


def config() -> TrainConfig:
    return TrainConfig(
        name="llama31_8b",
        model=MODEL,
        target="checkpoints/Llama-3.1-8B-Instruct",
        stages=paper_stages(max_offset=30_000, long_seq_len=32_768, data_root="data", sft=False),
        num_gpus=8,
        gpu_name="A100-80GB",
        gpu_memory_gb=80.0,
        output_dir="runs/llama31_8b",
    )
