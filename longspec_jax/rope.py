"""Rotary position embeddings (HF "rotate_half" layout), with linear and llama3 scaling."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from longspec_jax.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> np.ndarray:
    """float32[head_dim // 2]: the per-pair rotation rates after scaling."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    s = config.rope_scaling
    if s.kind == "linear":
        inv_freq = inv_freq / s.factor
    elif s.kind == "llama3":
        low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
        high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor
        )
        scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv_freq = np.where(mid, (1 - smooth) * inv_freq / s.factor + smooth * inv_freq, scaled)
    return inv_freq.astype(np.float32)


def rope_tables(positions: jnp.ndarray, inv_freq: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """(cos, sin), each float32[B, T, 1, D/2], for positions int32[B, T]: computed once per forward
    and shared by every layer (and by q and k)."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    return jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]


def rotate(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """Rotate x: [B, T, H, D] by `rope_tables`' (cos, sin). Computed in float32, returned in x.dtype."""
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def apply_rope(x: jnp.ndarray, positions: jnp.ndarray, inv_freq: jnp.ndarray) -> jnp.ndarray:
    """Rotate x: [B, T, H, D] at positions: int32[B, T]. Computed in float32, returned in x.dtype."""
    return rotate(x, *rope_tables(positions, inv_freq))
