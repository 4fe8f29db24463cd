"""SmolLM2-135M-Instruct, the embedded demo target (8k context), on one H200.

The data defaults to this repository's own Python sources and docs (local, our licence); point
`--data` at a larger local corpus for a real draft. Stage 2 trains at the target's full 8k window.
"""

from longspec_jax.config import ModelConfig
from train.config import EMBEDDED_TARGET, Stage, TrainConfig

MODEL = ModelConfig(
    model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
    num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
    max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,),
)

REPO_TEXT = ("longspec_jax", "train", "docs")


def config() -> TrainConfig:
    return TrainConfig(
        name="smollm2_135m",
        model=MODEL,
        target=EMBEDDED_TARGET,
        stages=(
            Stage(data=REPO_TEXT, seq_len=1024, batch_size=64, lr=5e-4, micro_batch_size=64,
                  anchor_offset=True, max_offset=8000),
            Stage(data=REPO_TEXT, seq_len=8192, batch_size=16, lr=5e-6, micro_batch_size=8,
                  anchor_offset=False, max_offset=8192),
        ),
        num_gpus=1, gpu_name="H200", gpu_memory_gb=141.0,
        checkpoint_every=200,
        output_dir="runs/smollm2_135m",
    )
