"""Split-K flash-decoding over the KV cache: T queries against keys [0, cache_len[b]), no mask.

Verification reads a cache of tens of thousands of keys with only T (<= 128) queries per head, so a
grid over query blocks alone would leave most of the GPU idle. Instead each program takes one
(batch, KV head, row block) and one of num_splits contiguous slices of that sequence's valid keys,
and writes a partial (o, lse); one more kernel (split_combine) merges the slices. Each program holds
all GQA heads of its KV head (flash_block), so a K/V tile is loaded once for the whole group.

Slices are cut from the true length cache_len[b], not the cache capacity (split_plan): each holds at
least MIN_TILES_PER_SPLIT key tiles, so a sequence that fills a fraction of a roomy cache (a 4.5k
prompt in the 8k rows of its power-of-two cache) uses only the splits it fills. Splits past those
fold nothing and write nothing; the combine reads only the partials written, their count per
sequence being computed from the same lengths.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import flash_block as fb
from pallas_kernels.split_combine import MIN_TILES_PER_SPLIT, combine_splits, split_plan

# Enough programs to fill an H200 (132 SMs) about four times over. On the H200 a fixed 8 or 32
# splits were 0-21% slower than this choice at T = 74, S = 32k (benchmark tuning, 2026-11-29).
TARGET_PROGRAMS = 528
# At head dim 128, a grid whose row blocks are one small tile (an AR step's 1-16 query rows a KV
# head) aims at one wave instead: each program does little beyond streaming its keys, and every
# split is one more partial to merge. On the H200 at 32k cached keys the AR step's attention took
# 44.2 against 50.3 us a layer at Llama-3-8B's shape (16 splits against 66) and 136.6 against 141.9
# at Vicuna-7B's (4 against 17; `python -m benchmarks.tune_decode_attention --tree-sizes 1`,
# 2026-12-04). Not at SmolLM2's head dim 64: at batch 8 its AR step took 16.2 us a layer with one
# wave's 6 splits against 14.7 with 22 (`--splits`), so small heads keep TARGET_PROGRAMS.
SMALL_BLOCK_TARGET_PROGRAMS = fb.NUM_SMS


def fold_cache_split(state, q, k_ref, v_ref, length, split, plan, block_keys: int, scale: float):
    """Folds slice `split` of the keys [0, length) of k_ref, v_ref [S, D] into state, the slices
    being split_plan's (`plan`, its result). A split past the last slice folds nothing."""
    num_tiles, per_split, _ = plan
    first = split * per_split
    last = jnp.minimum(first + per_split, num_tiles)

    def fold_key_tile(i, state):
        key0 = i * block_keys
        key_ok = key0 + jnp.arange(block_keys) < length
        k = fb.load_rows(k_ref, key0, block_keys, key_ok)
        v = fb.load_rows(v_ref, key0, block_keys, key_ok)
        return fb.online_softmax_step(state, q, k, v, key_ok[None, :], scale)

    return lax.fori_loop(first, last, fold_key_tile, state)


def _split_kernel(
    len_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, scale, block_rows, block_keys, group, num_rows, num_splits
):
    """One row block of one (batch, KV head) against one slice of that sequence's cache."""
    row0, row_ok, query, head = fb.query_rows(block_rows, num_rows, group)
    split, length = pl.program_id(3), jnp.minimum(len_ref[()], k_ref.shape[0])  # capped at the capacity
    plan = split_plan(length, num_splits, block_keys)
    rows_active = row_ok & (split < plan[2])  # a split past the keys loads and writes nothing
    q = fb.load_query_rows(q_ref, query, head, rows_active)
    state = fb.empty_state(block_rows, q.shape[-1])
    state = fold_cache_split(state, q, k_ref, v_ref, length, split, plan, block_keys, scale)
    fb.store_partial(o_ref, lse_ref, split, row0, rows_active, state)


def default_num_splits(
    programs_per_split: int,
    capacity: int,
    block_keys: int,
    extra_parts: int = 0,
    target_programs: int = TARGET_PROGRAMS,
) -> int:
    """Splits so the grid has about target_programs programs, no more than a full cache fills.

    Where the capacity is what bounds them (a small model's cache, whose fill the static grid cannot
    know), the slots a sequence leaves empty still cost their launch: at SmolLM2's 64-token verify a
    4.5k-token sequence in an 8,192-row cache took 15.5 us a layer with 32 splits (198 programs, two
    waves, 18 splits holding keys) and 13.4-13.8 with 16-24. So there the grid keeps to one wave
    (flash_block.NUM_SMS programs, extra_parts being the partials it writes besides the splits')
    unless that leaves fewer splits than a half-full cache fills; the AR step's 3 rows a KV head (99
    programs at 32 splits) keep theirs, which ran 8.1 against 8.6-9.1 us with 16-24."""
    want = pl.cdiv(target_programs, programs_per_split)
    full = max(1, capacity // (MIN_TILES_PER_SPLIT * block_keys))
    if want <= full:
        return want
    one_wave = fb.NUM_SMS // programs_per_split - extra_parts
    return max(full // 2, min(full, one_wave), 1)


def split_grid(q, k_cache, block_rows: int, block_keys: int, num_splits, extra_parts: int = 0):
    """(group, rows, block_rows, row blocks, num_splits) of a split-K grid over q [B,T,Hq,D] and a
    cache [B,S,Hkv,D]; num_splits=None picks it from the grid size (default_num_splits)."""
    b, t, hq, _ = q.shape
    s, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    rows = t * group
    block_rows = fb.block_size(rows, block_rows)
    row_blocks = pl.cdiv(rows, block_rows)
    if num_splits is None:
        wide_ar_step = rows <= fb.MIN_BLOCK and q.shape[-1] > 64
        target = SMALL_BLOCK_TARGET_PROGRAMS if wide_ar_step else TARGET_PROGRAMS
        num_splits = default_num_splits(b * hkv * row_blocks, s, block_keys, extra_parts, target)
    return group, rows, block_rows, row_blocks, num_splits


def split_specs(q, k_cache, num_parts: int, rows: int):
    """BlockSpecs and shapes shared by the split-K kernels: inputs (cache_len, q, k_cache, v_cache)
    and outputs (partials o [B,Hkv,P,rows,D] float32, lse [B,Hkv,P,rows]), grid (B, Hkv, row
    blocks, P). Each program sees all P partials of its (batch, KV head): which slot it writes
    depends on the sequence's length (split_plan)."""
    b, t, hq, d = q.shape
    s, hkv = k_cache.shape[1], k_cache.shape[2]
    in_specs = [
        pl.BlockSpec((None,), lambda i, h, r, j: (i,)),
        pl.BlockSpec((None, t, hq, d), lambda i, h, r, j: (i, 0, 0, 0)),
        pl.BlockSpec((None, s, None, d), lambda i, h, r, j: (i, 0, h, 0)),
        pl.BlockSpec((None, s, None, d), lambda i, h, r, j: (i, 0, h, 0)),
    ]
    out_specs = [
        pl.BlockSpec((None, None, num_parts, rows, d), lambda i, h, r, j: (i, h, 0, 0, 0)),
        pl.BlockSpec((None, None, num_parts, rows), lambda i, h, r, j: (i, h, 0, 0)),
    ]
    out_shape = [
        jax.ShapeDtypeStruct((b, hkv, num_parts, rows, d), jnp.float32),
        jax.ShapeDtypeStruct((b, hkv, num_parts, rows), jnp.float32),
    ]
    return in_specs, out_specs, out_shape


@functools.partial(
    jax.jit, static_argnames=("scale", "interpret", "block_rows", "block_keys", "num_splits", "num_warps", "num_stages")
)
def _cache_attention(
    q, k_cache, v_cache, cache_len, *, scale, interpret, block_rows, block_keys, num_splits, num_warps, num_stages
):
    b, t = q.shape[:2]
    hkv = k_cache.shape[2]
    group, rows, block_rows, row_blocks, num_splits = split_grid(q, k_cache, block_rows, block_keys, num_splits)
    kernel = functools.partial(
        _split_kernel,
        scale=scale,
        block_rows=block_rows,
        block_keys=block_keys,
        group=group,
        num_rows=rows,
        num_splits=num_splits,
    )
    in_specs, out_specs, out_shape = split_specs(q, k_cache, num_splits, rows)
    lengths = cache_len.astype(jnp.int32)  # each kernel caps them at the capacity: no XLA kernel does
    o_parts, lse_parts = pl.pallas_call(
        kernel,
        grid=(b, hkv, row_blocks, num_splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="cache_split_k_attn",
    )(lengths, q, k_cache, v_cache)
    return combine_splits(
        o_parts,
        lse_parts,
        lengths,
        num_queries=t,
        out_dtype=q.dtype,
        with_lse=True,
        interpret=interpret,
        cut=(num_splits, block_keys, 0, k_cache.shape[1]),
    )


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
