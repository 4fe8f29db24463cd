"""Vicuna-7B-v1.5-16k (Llama-2, linear RoPE x4, 16k context) on 8x A100-80GB, as in the paper.

MAX_LEN is 15k for this target (SPEC.md 4); its long stage uses its full 16k context, not 32k.
Download the checkpoint and data yourself, then:
`python -m train.run --config vicuna7b.py --target PATH --data PATH [--stage 2]`.
"""

from longspec_jax.config import ModelConfig, RopeScaling
from train.config import TrainConfig
from train.configs._paper import paper_stages

MODEL = ModelConfig(
    model_type="llama",
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=11008,
    num_layers=32,
    num_heads=32,
    num_kv_heads=32,
    head_dim=128,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    rope_scaling=RopeScaling(kind="linear", factor=4.0),
    max_position_embeddings=16384,
    bos_token_id=1,
    eos_token_ids=(2,),
)


def config() -> TrainConfig:
    return TrainConfig(
        name="vicuna7b",
        model=MODEL,
        target="checkpoints/vicuna-7b-v1.5-16k",
        stages=paper_stages(max_offset=15_000, long_seq_len=16_384, data_root="data", sft=False),
        num_gpus=8,
        gpu_name="A100-80GB",
        gpu_memory_gb=80.0,
        output_dir="runs/vicuna7b",
    )
