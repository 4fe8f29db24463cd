"""Anchor-Offset Indices (docs/ALGORITHM.md 4): training positions [0, 1, .., a-1, o+a, o+a+1, ..].

The draft is trained on short sequences but runs at large positions, and its RoPE cannot change
(it reads the target's rotated keys). Shifting all but the first `num_anchors` positions by a
random offset o ~ U{0 .. max_len - L} trains large positions while keeping the attention-sink
tokens at 0..a-1. The target gets the same positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from longspec_jax.errors import UserError

DEFAULT_ANCHORS = 4


def _check(length: int, max_len: int, num_anchors: int) -> None:
    if length > max_len:
        raise UserError(
            f"sequence length {length} exceeds the anchor-offset max_len {max_len}: "
            "raise max_len or shorten the sequences"
        )
    if not 0 <= num_anchors <= length:
        raise UserError(f"num_anchors={num_anchors} must lie in 0..{length} (the sequence length)")


def anchor_offset_positions(
    rng: np.random.Generator, length: int, max_len: int, *, num_anchors: int = DEFAULT_ANCHORS, batch: int = 1
):
    """int32[batch, length] positions, one offset per row drawn with a numpy Generator."""
    _check(length, max_len, num_anchors)
    offsets = rng.integers(0, max_len - length, size=(batch, 1), endpoint=True)
    shift = np.where(np.arange(length) >= num_anchors, offsets, 0)
    return (np.arange(length)[None, :] + shift).astype(np.int32)


def anchor_offset_positions_jax(
    key: jax.Array, length: int, max_len: int, *, num_anchors: int = DEFAULT_ANCHORS, batch: int = 1
):
    """As `anchor_offset_positions`, drawn with a JAX key (usable inside jit; sizes static)."""
    _check(length, max_len, num_anchors)
    offsets = jax.random.randint(key, (batch, 1), 0, max_len - length + 1, dtype=jnp.int32)
    shift = jnp.where(jnp.arange(length) >= num_anchors, offsets, 0)
    return (jnp.arange(length, dtype=jnp.int32)[None, :] + shift).astype(jnp.int32)
