"""QwQ-32B (Qwen2 family: GQA 40/8, q/k/v bias, theta 1e6) on 8x A100-80GB, with the LongCoT SFT stage."""

from longspec_jax.config import ModelConfig
from train.config import TrainConfig
from train.configs._paper import paper_stages

MODEL = ModelConfig(
    model_type="qwen2",
    vocab_size=152064,
    hidden_size=5120,
    intermediate_size=27648,
    num_layers=64,
    num_heads=40,
    num_kv_heads=8,
    head_dim=128,
    rms_norm_eps=1e-5,
    rope_theta=1_000_000.0,
    max_position_embeddings=40960,
    qkv_bias=True,
    bos_token_id=151643,
    eos_token_ids=(151645,),
)


def config() -> TrainConfig:
    return TrainConfig(
        name="qwq32b",
        model=MODEL,
        target="checkpoints/QwQ-32B",
        stages=paper_stages(max_offset=30_000, long_seq_len=32_768, data_root="data", sft=True),
        num_gpus=8,
        gpu_name="A100-80GB",
        gpu_memory_gb=80.0,
        output_dir="runs/qwq32b",
    )
