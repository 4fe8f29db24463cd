"""The merge after split-K attention, as one kernel: P partial results per query row -> one.

Each partial (o_p, lse_p) is attention over a disjoint slice of the keys, o_p normalised over its
slice and lse_p the natural-log log-sum-exp of its scaled scores (-inf when the slice held no
visible key). With m = max_p lse_p, the whole is o = sum_p o_p e^(lse_p - m) / sum_p e^(lse_p - m)
and lse = m + log(sum_p e^(lse_p - m)). A row no slice saw gives o = 0, lse = -inf, never NaN.

Only the first parts_used[b] of the P slots hold partials (the attention kernels cut a short
sequence into fewer slices than a roomy cache allows); the slots past them are never read. One
program per (batch, KV head, block of up to 16 query rows) takes those partials a chunk of C at a
time (one [C, rows, D] load each, C a power of two, the last chunk shifted back to stay in bounds
with the parts it repeats or should not read masked off) and merges them as it goes,
online-softmax style: a running max of the lse rescales what came before. A loop over single
partials would wait on one small load after another (P is 40-70 at batch 1: ~9 us on the H200 for
3 KV heads, more than the attention itself). The output goes to q's layout [B, T, Hq, D] directly
(flash_block.query_rows), so no XLA transpose follows.

How the split-K kernels cut a sequence's cached keys into slices (`split_plan`) lives here too: the
combine can then count a sequence's partials from its length itself (`cut`), where XLA would run a
kernel to count them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import flash_block as fb

# Query rows per program: few, so even one KV head at batch 1 spreads over several programs. Fewer
# rows than this (an AR step's G rows) get the smallest power of two that holds them: no dot here
# needs Triton's 16, and the rows not loaded leave room for more partials per chunk.
BLOCK_ROWS = 16
# Partials x rows x head dim loaded at once: 8192 float32, 64 registers a thread with 4 warps.
CHUNK_ELEMENTS = 8192


# Key tiles a split holds at least. A program's fixed cost (loading and rotating its query rows,
# writing its partial, a combine input more) is worth several tiles: on the H200 at SmolLM2's verify
# shape (64 tokens x 3 query heads per KV head, 4.5k cached keys) 18 splits of 4 tiles took 12.9 us
# a layer, 24 splits of 3 tiles 20.0 us, 15 of 5 tiles 14.0 us (`benchmarks.tune_decode_attention`).
MIN_TILES_PER_SPLIT = 4


def split_plan(length, num_splits: int, block_keys: int):
    """(key tiles, tiles per split, splits holding keys) for a sequence of `length` cached keys cut
    into at most num_splits slices of whole tiles, each of at least MIN_TILES_PER_SPLIT tiles (the
    last may hold fewer). Plain integer ops: usable inside the kernels and in XLA on an int32[B]."""
    # lax.div (truncating) on these non-negative ints: Python's // would add floor-sign fixups.
    num_tiles = lax.div(length + block_keys - 1, block_keys)
    per_split = jnp.maximum(lax.div(num_tiles + num_splits - 1, num_splits), MIN_TILES_PER_SPLIT)
    return num_tiles, per_split, lax.div(num_tiles + per_split - 1, per_split)


def parts_per_chunk(num_parts: int, block_rows: int, head_dim: int) -> int:
    """The power of two C <= num_parts that keeps a [C, block_rows, head_dim] chunk in registers."""
    cap = max(1, CHUNK_ELEMENTS // (block_rows * head_dim))
    c = 1
    while c * 2 <= min(num_parts, cap):
        c *= 2
    return c


def _combine_kernel(
    used_ref, o_parts_ref, lse_parts_ref, o_ref, *lse_ref, block_rows, num_rows, num_parts, group, chunk, cut
):
    """The first used_ref[()] partials of o_parts [P, rows, D], lse_parts [P, rows] of one (batch,
    KV head) -> o [T, Hq, D] (and lse [Hq, T] when asked) at this program's rows; with cut, the
    count is split_plan's for the cached length used_ref[()] holds (capped at cut's capacity), plus
    cut's extra parts."""
    row0, row_ok, query, head = fb.query_rows(block_rows, num_rows, group)
    used = used_ref[()]
    if cut is not None:
        num_splits, block_keys, extra, capacity = cut
        used = split_plan(jnp.minimum(used, capacity), num_splits, block_keys)[2] + extra
    used = jnp.minimum(used, num_parts)

    def merge(c, carry):
        acc, total, top = carry
        start = jnp.minimum(c * chunk, num_parts - chunk)  # in bounds; parts before c * chunk are done
        part = start + jnp.arange(chunk)
        ok = ((part >= c * chunk) & (part < used))[:, None] & row_ok[None, :]
        lse = plgpu.load(lse_parts_ref.at[pl.ds(start, chunk), pl.ds(row0, block_rows)], mask=ok, other=-jnp.inf)
        o = plgpu.load(o_parts_ref.at[pl.ds(start, chunk), pl.ds(row0, block_rows), :], mask=ok[:, :, None], other=0.0)
        new_top = jnp.maximum(top, jnp.max(lse, axis=0))
        # Rows no part has seen yet keep top = -inf: shift them by 0, so every weight is e^-inf = 0.
        shift = jnp.where(new_top == -jnp.inf, 0.0, new_top)
        scale = jnp.exp(top - shift)
        weight = jnp.exp(lse - shift[None, :])
        acc = acc * scale[:, None] + jnp.sum(o * weight[:, :, None], axis=0)
        return acc, total * scale + jnp.sum(weight, axis=0), new_top

    empty = (
        jnp.zeros((block_rows, o_parts_ref.shape[-1]), jnp.float32),
        jnp.zeros((block_rows,), jnp.float32),
        jnp.full((block_rows,), -jnp.inf, jnp.float32),
    )
    acc, total, top = lax.fori_loop(0, lax.div(used + chunk - 1, chunk), merge, empty)
    seen = total > 0.0
    safe_total = jnp.where(seen, total, 1.0)
    fb.store_query_rows(o_ref, query, head, row_ok, acc / safe_total[:, None])
    if lse_ref:
        lse = jnp.where(seen, top + jnp.log(safe_total), -jnp.inf)
        plgpu.store(lse_ref[0].at[head, query], lse, mask=row_ok)


@functools.partial(jax.jit, static_argnames=("num_queries", "out_dtype", "with_lse", "interpret", "cut"))
def combine_splits(
    o_parts, lse_parts, parts_used, *, num_queries: int, out_dtype, with_lse: bool, interpret: bool, cut=None
):
    """Merges partials o [B, Hkv, P, T * G, D] (float32 or 16-bit) and lse [B, Hkv, P, T * G] over their first
    parts_used[b] (int32 [B], at most P) slots; what the other slots hold is never read. With cut =
    (num_splits, block_keys, extra parts, cache capacity), parts_used holds each sequence's cached
    length instead (capped at the capacity here), and the kernel counts its partials from it as
    split_plan cuts the keys, plus the extra parts after them: no XLA kernel computes the counts.

    Rows are in flash_block's order (row t * G + g of KV head h is query t of head h * G + g).
    Returns o [B, T, Hq, D] in out_dtype and, with with_lse, lse float32 [B, Hq, T] (else None).
    """
    b, hkv, num_parts, rows, d = o_parts.shape
    group = rows // num_queries
    hq = hkv * group
    block_rows = 1 << (min(rows, BLOCK_ROWS) - 1).bit_length()
    chunk = parts_per_chunk(num_parts, block_rows, d)
    kernel = functools.partial(
        _combine_kernel,
        block_rows=block_rows,
        num_rows=rows,
        num_parts=num_parts,
        group=group,
        chunk=chunk,
        cut=cut,
    )
    out_specs = [pl.BlockSpec((None, num_queries, hq, d), lambda i, h, r: (i, 0, 0, 0))]
    out_shape = [jax.ShapeDtypeStruct((b, num_queries, hq, d), out_dtype)]
    if with_lse:
        out_specs.append(pl.BlockSpec((None, hq, num_queries), lambda i, h, r: (i, 0, 0)))
        out_shape.append(jax.ShapeDtypeStruct((b, hq, num_queries), jnp.float32))
    out = pl.pallas_call(
        kernel,
        grid=(b, hkv, pl.cdiv(rows, block_rows)),
        in_specs=[
            pl.BlockSpec((None,), lambda i, h, r: (i,)),
            pl.BlockSpec((None, None, num_parts, rows, d), lambda i, h, r: (i, h, 0, 0, 0)),
            pl.BlockSpec((None, None, num_parts, rows), lambda i, h, r: (i, h, 0, 0)),
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="split_k_combine",
    )(parts_used.astype(jnp.int32), o_parts, lse_parts)
    return (out[0], out[1]) if with_lse else (out[0], None)
