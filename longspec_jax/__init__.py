"""longspec-jax: LongSpec long-context lossless speculative decoding in JAX / Flax NNX / Pallas."""

from longspec_jax.config import ModelConfig, RopeScaling
from longspec_jax.errors import UserError

__all__ = ["ModelConfig", "RopeScaling", "UserError"]
