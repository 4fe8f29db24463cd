"""Float64 NumPy references for the attention kernels (tests and the GPU benchmark's check).

Kept in NumPy, apart from JAX, so the reference shares no code path (and no float32 rounding) with
what it checks.
"""

from __future__ import annotations

import numpy as np


def attention_reference(q, k, v, mask, scale=None):
    """Masked attention in float64: q [B,T,Hq,D], k/v [B,N,Hkv,D], mask bool[B,T,N].

    Returns (o [B,T,Hq,D], lse [B,Hq,T]); query head h reads KV head h // (Hq // Hkv). A fully
    masked row gives o = 0 and lse = -inf.
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    mask = np.asarray(mask, bool)
    group = q.shape[2] // k.shape[2]
    k = np.repeat(k, group, axis=2)
    v = np.repeat(v, group, axis=2)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    # Batched matmuls ([B, H, T, D] @ [B, H, D, N]) go through BLAS; einsum would not.
    scores = (q.transpose(0, 2, 1, 3) @ k.transpose(0, 2, 3, 1)) * scale
    scores = np.where(mask[:, None], scores, -np.inf)
    top = scores.max(axis=-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    p = np.exp(scores - top)
    total = p.sum(axis=-1, keepdims=True)
    seen = total > 0
    o = ((p / np.where(seen, total, 1.0)) @ v.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    lse = np.where(seen, np.log(np.where(seen, total, 1.0)) + top, -np.inf)[..., 0]
    return o, lse


def cache_visibility(cache_len, num_queries: int, capacity: int):
    """bool [B, T, S]: key s is visible to every query iff s < cache_len[b]."""
    cache_len = np.asarray(cache_len)
    visible = np.arange(capacity)[None, None, :] < cache_len[:, None, None]
    return np.broadcast_to(visible, (cache_len.shape[0], num_queries, capacity))


def block_visibility(cache_len, block_mask, capacity: int):
    """bool [B, T, S]: every query sees cache rows [0, cache_len[b]), and row cache_len[b] + j (the
    block's own key j, written after the cache) where block_mask[b, t, j]."""
    block_mask = np.asarray(block_mask)
    b, t, _ = block_mask.shape
    visible = np.array(cache_visibility(cache_len, t, capacity))
    for i, n in enumerate(np.asarray(cache_len)):
        visible[i, :, n : n + t] = block_mask[i]
    return visible


def rotated(x, cos, sin):
    """RoPE (rotate-half, rope.rotate's layout) in float64: x [B,T,H,D], cos/sin [B,T,D/2]."""
    x, cos, sin = (np.asarray(a, np.float64) for a in (x, np.asarray(cos)[:, :, None], np.asarray(sin)[:, :, None]))
    x1, x2 = np.split(x, 2, axis=-1)
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def with_rows_written(cache, new, lengths):
    """cache [B,S,H,D] with new [B,N,H,D] at rows [lengths[b], lengths[b] + N), the rows past S
    dropped, as NumPy."""
    out = np.array(cache)
    for b, n in enumerate(np.asarray(lengths)):
        rows = min(new.shape[1], out.shape[1] - n)
        out[b, n : n + rows] = new[b, :rows]
    return out


def random_tree_mask(rng, batch: int, size: int):
    """bool [B, size, size] of random valid trees: node i (parent < i) sees its ancestors and itself."""
    mask = np.zeros((batch, size, size), bool)
    for b in range(batch):
        for i in range(size):
            mask[b, i, i] = True
            if i:
                mask[b, i] |= mask[b, rng.integers(0, i)]
    return mask
