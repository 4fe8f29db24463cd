"""Llama-3.1-8B-Instruct (GQA 32/8, llama3 RoPE scaling, 128k context) on 8x A100-80GB."""

from longspec_jax.model_shapes import MODEL_SHAPES
from train.config import TrainConfig
from train.configs._paper import paper_stages

MODEL = MODEL_SHAPES["llama31_8b"]


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
