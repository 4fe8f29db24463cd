"""Split-K flash-decoding over the KV cache: T queries against keys [0, cache_len[b]), no mask.

Verification reads a cache of tens of thousands of keys with only T (<= 128) queries per head, so a
grid over query blocks alone would leave most of the GPU idle. Instead each program takes one
(batch, KV head, row block) and one of num_splits contiguous slices of that sequence's valid keys,
and writes a partial (o, lse); a short XLA combine merges the slices. Each program holds all GQA
heads of its KV head (flash_block), so a K/V tile is loaded once for the whole group.

Slices are cut from the true length cache_len[b] (not the cache capacity), so a short sequence in a
big cache still spreads over every split; splits past the end run zero iterations and write
o = 0, lse = -inf, which the combine ignores.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import flash_block as fb

# Enough programs to fill an H200 (132 SMs) about four times over. On the H200 a fixed 8 or 32
# splits were 0-21% slower than this choice at T = 74, S = 32k (benchmark tuning, 2026-11-29).
TARGET_PROGRAMS = 528


def _split_kernel(len_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, scale, block_rows, block_keys, num_rows, num_splits):
    """One row block of one (batch, KV head) against one slice of that sequence's cache."""
    row0 = pl.program_id(2) * block_rows
    row_ok = row0 + jnp.arange(block_rows) < num_rows
    q = fb.load_rows(q_ref, row0, block_rows, row_ok)

    length = len_ref[()]
    # lax.div (truncating) on these non-negative ints: Python's // would add floor-sign fixups.
    num_tiles = lax.div(length + block_keys - 1, block_keys)
    tiles_per_split = lax.div(num_tiles + num_splits - 1, num_splits)
    first = pl.program_id(3) * tiles_per_split
    last = jnp.minimum(first + tiles_per_split, num_tiles)

    def fold_key_tile(i, state):
        key0 = i * block_keys
        key_ok = key0 + jnp.arange(block_keys) < length
        k = fb.load_rows(k_ref, key0, block_keys, key_ok)
        v = fb.load_rows(v_ref, key0, block_keys, key_ok)
        return fb.online_softmax_step(state, q, k, v, key_ok[None, :], scale)

    state = lax.fori_loop(first, last, fold_key_tile, fb.empty_state(block_rows, q.shape[-1]))
    o, lse = fb.finish_state(state)
    plgpu.store(o_ref.at[pl.ds(row0, block_rows), :], o, mask=row_ok[:, None])
    plgpu.store(lse_ref.at[pl.ds(row0, block_rows)], lse, mask=row_ok)


def combine_splits(o_parts, lse_parts):
    """Merge partials o [..., P, R, D] (each normalised over its slice) and lse [..., P, R] over P."""
    top = jnp.max(lse_parts, axis=-2, keepdims=True)
    top = jnp.where(top == -jnp.inf, 0.0, top)
    weight = jnp.exp(lse_parts - top)  # 0 for empty slices
    total = jnp.sum(weight, axis=-2)
    seen = total > 0.0
    o = jnp.sum(o_parts * weight[..., None], axis=-3) / jnp.where(seen, total, 1.0)[..., None]
    lse = jnp.where(seen, top[..., 0, :] + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)
    return o, lse


def default_num_splits(programs_per_split: int, capacity: int, block_keys: int) -> int:
    """Splits so the grid has about TARGET_PROGRAMS programs, each with at least 4 key tiles."""
    want = pl.cdiv(TARGET_PROGRAMS, programs_per_split)
    return max(1, min(want, capacity // (4 * block_keys)))


@functools.partial(
    jax.jit, static_argnames=("scale", "interpret", "block_rows", "block_keys", "num_splits", "num_warps", "num_stages")
)
def _cache_attention(
    q, k_cache, v_cache, cache_len, *, scale, interpret, block_rows, block_keys, num_splits, num_warps, num_stages
):
    b, t, hq, d = q.shape
    s, hkv = k_cache.shape[1], k_cache.shape[2]
    rows = t * (hq // hkv)
    block_rows = fb.block_size(rows, block_rows)
    row_blocks = pl.cdiv(rows, block_rows)
    if num_splits is None:
        num_splits = default_num_splits(b * hkv * row_blocks, s, block_keys)
    kernel = functools.partial(
        _split_kernel, scale=scale, block_rows=block_rows, block_keys=block_keys, num_rows=rows, num_splits=num_splits
    )
    o_parts, lse_parts = pl.pallas_call(
        kernel,
        grid=(b, hkv, row_blocks, num_splits),
        in_specs=[
            pl.BlockSpec((None,), lambda i, h, r, j: (i,)),
            pl.BlockSpec((None, None, rows, d), lambda i, h, r, j: (i, h, 0, 0)),
            pl.BlockSpec((None, s, None, d), lambda i, h, r, j: (i, 0, h, 0)),
            pl.BlockSpec((None, s, None, d), lambda i, h, r, j: (i, 0, h, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, d), lambda i, h, r, j: (i, h, j, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda i, h, r, j: (i, h, j, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, hkv, num_splits, rows, d), jnp.float32),
            jax.ShapeDtypeStruct((b, hkv, num_splits, rows), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="cache_split_k_attn",
    )(jnp.minimum(cache_len.astype(jnp.int32), s), fb.group_query_rows(q, hkv), k_cache, v_cache)
    o_rows, lse_rows = combine_splits(o_parts, lse_parts)
    return fb.ungroup_output(o_rows.astype(q.dtype), t), fb.ungroup_lse(lse_rows, t)


def cache_attention(
    q,
    k_cache,
    v_cache,
    cache_len,
    *,
    scale=None,
    interpret=None,
    block_rows=128,
    block_keys=64,
    num_splits=None,
    num_warps=8,
    num_stages=3,
):
    """q [B,T,Hq,D] against cache keys [0, cache_len[b]) of k_cache, v_cache [B,S,Hkv,D], no mask.

    Returns (o [B,T,Hq,D] in q.dtype, lse float32 [B,Hq,T], natural log of the scaled scores).
    cache_len[b] = 0 gives o = 0, lse = -inf. num_splits=None picks it from the grid size.
    """
    fb.check_grouped_shapes(q, k_cache, v_cache, "cache_attention")
    if cache_len.shape != (q.shape[0],):
        raise ValueError(f"cache_attention: cache_len must be int32[B={q.shape[0]}], got {cache_len.shape}")
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    interpret = fb.default_interpret() if interpret is None else interpret
    return _cache_attention(
        q,
        k_cache,
        v_cache,
        cache_len,
        scale=scale,
        interpret=interpret,
        block_rows=block_rows,
        block_keys=block_keys,
        num_splits=num_splits,
        num_warps=num_warps,
        num_stages=num_stages,
    )
