"""longspec-jax: LongSpec long-context lossless speculative decoding in JAX / Flax NNX / Pallas."""

from longspec_jax import quiet_logs  # noqa: F401  (before anything imports transformers)
from longspec_jax.config import ModelConfig, RopeScaling
from longspec_jax.draft_io import Draft, init_draft, load_draft
from longspec_jax.errors import GenerationInterrupted, UserError
from longspec_jax.generation import GenerationResult, GenerationStats, Generator, generate
from longspec_jax.model import KVCache, commit, init_cache
from longspec_jax.target import Target, load_target, random_target

__all__ = [
    "Draft",
    "GenerationInterrupted",
    "GenerationResult",
    "GenerationStats",
    "Generator",
    "KVCache",
    "ModelConfig",
    "RopeScaling",
    "Target",
    "UserError",
    "commit",
    "generate",
    "init_cache",
    "init_draft",
    "load_draft",
    "load_target",
    "random_target",
]
