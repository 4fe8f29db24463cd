"""Vicuna-7B-v1.5-16k (Llama-2, linear RoPE x4, 16k context) on 8x A100-80GB, as in the paper.

MAX_LEN is 15k for this target (docs/ALGORITHM.md 4); its long stage uses its full 16k context, not 32k.
Download the checkpoint and data yourself, then:
`python -m train.run --config vicuna7b.py --target PATH --data PATH [--stage 2]`.
"""

from longspec_jax.model_shapes import MODEL_SHAPES
from train.config import TrainConfig
from train.configs._paper import paper_stages

MODEL = MODEL_SHAPES["vicuna7b"]


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
