"""CI: a tiny random-weight target and a tiny local corpus; trains in seconds on one CPU.

A random target has no tokenizer, so text is fed as UTF-8 bytes (ids 0..255, EOS 256).
"""

from pathlib import Path

from longspec_jax.config import ModelConfig
from train.config import RANDOM_TARGET, Stage, TrainConfig

MODEL = ModelConfig(
    model_type="llama",
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=4096,
    eos_token_ids=(256,),
)

CORPUS = str(Path(__file__).resolve().parent.parent / "corpus" / "tiny.txt")


def config() -> TrainConfig:
    return TrainConfig(
        name="tiny",
        model=MODEL,
        target=RANDOM_TARGET,
        stages=(
            Stage(
                data=(CORPUS,),
                seq_len=64,
                batch_size=8,
                lr=1e-2,
                micro_batch_size=4,
                anchor_offset=True,
                max_offset=1024,
                max_steps=30,
            ),
        ),
        mesh=(1, -1, 1),
        num_gpus=1,
        gpu_name="CPU",
        gpu_memory_gb=1.0,
        compute_dtype="float32",
        checkpoint_every=10,
        keep_checkpoints=2,
        log_every=5,
        output_dir="runs/tiny",
    )
