"""QwQ-32B (Qwen2 family: GQA 40/8, q/k/v bias, theta 1e6) on 8x A100-80GB, with the LongCoT SFT stage."""

from longspec_jax.model_shapes import MODEL_SHAPES
from train.config import TrainConfig
from train.configs._paper import paper_stages

MODEL = MODEL_SHAPES["qwq32b"]


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
