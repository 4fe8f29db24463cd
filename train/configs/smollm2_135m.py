"""SmolLM2-135M-Instruct, the embedded demo target (8k context), on one H200.

Both stages read the corpus that `train/build_corpus.py` writes, gzipped, to `.stage/corpus`
(git-ignored; see DATA.md). Stage 2 trains at the target's full 8k window, starting from stage 1's
exported draft. `benchmarks/smollm2_draft_pipeline.sh` builds the corpus, runs both and benchmarks the draft.

Step counts are sized from FLOPs so that stage 1 takes about 4 min and stage 2 about 1 min on one
H200 at ~40 % of its ~700 TFLOP/s usable bf16 peak = 280 TFLOP/s. Per trained token:
  target forward (frozen)        2 x 135 M                       = 270 MFLOP
  draft forward + backward       6 x 4.4 M                       =  26 MFLOP
  LM head (576 x 49152) fwd+bwd  6 x 28.3 M                      = 170 MFLOP
  attention, causal (S = seq)    2 x S x 576 x (30 target layers fwd + 3 x 1 draft layer)
                                   S = 1024: 39 MFLOP; S = 8192: 311 MFLOP
Stage 1: 505 MFLOP/token -> 280e12 / 505e6 = 554 k tokens/s; 240 s -> 133 M tokens
         = 2030 steps of 64 x 1024 tokens: max_steps 2000 (~12.5 passes over the 10.5 M-token corpus).
Stage 2: 777 MFLOP/token -> 360 k tokens/s; 60 s -> 21.6 M tokens
         = 165 steps of 16 x 8192 tokens: max_steps 160. Its lr is 5e-5, not the paper's 5e-6: the
         paper's stage 2 runs thousands of steps on a 7B draft; 160 steps at 5e-6 would not move this one.
Measured on the H200 (BENCHMARKS.md): 498 k and 412 k tokens/s, 4 min 40 s and 62 s of steps.
"""

from longspec_jax.model_shapes import MODEL_SHAPES
from train.config import EMBEDDED_TARGET, Stage, TrainConfig

MODEL = MODEL_SHAPES["smollm2_135m"]

CORPUS = (".stage/corpus",)  # relative to the repository root, where train.run is started


def config() -> TrainConfig:
    return TrainConfig(
        name="smollm2_135m",
        model=MODEL,
        target=EMBEDDED_TARGET,
        stages=(
            Stage(
                data=CORPUS,
                seq_len=1024,
                batch_size=64,
                lr=5e-4,
                micro_batch_size=64,
                anchor_offset=True,
                max_offset=8000,
                max_steps=2000,
            ),
            Stage(
                data=CORPUS,
                seq_len=8192,
                batch_size=16,
                lr=5e-5,
                micro_batch_size=8,
                anchor_offset=False,
                max_offset=8192,
                max_steps=160,
            ),
        ),
        num_gpus=1,
        gpu_name="H200",
        gpu_memory_gb=141.0,
        checkpoint_every=200,
        output_dir="runs/smollm2_135m",
    )
