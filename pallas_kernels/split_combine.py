"""The merge after split-K attention, as one kernel: P partial results per query row -> one.

Each partial (o_p, lse_p) is attention over a disjoint slice of the keys, o_p normalised over its
slice and lse_p the natural-log log-sum-exp of its scaled scores (-inf when the slice held no
visible key). With m = max_p lse_p, the whole is o = sum_p o_p e^(lse_p - m) / sum_p e^(lse_p - m)
and lse = m + log(sum_p e^(lse_p - m)). A row no slice saw gives o = 0, lse = -inf, never NaN.

One program per (batch, KV head, row block) walks the P partials twice: first the lse (a few bytes
a row) for m, then o. P (splits + 1 in the hybrid) is no power of two, so it is a loop, not a tile
dim. The output goes to q's layout [B, T, Hq, D] directly (flash_block.query_rows), so no XLA
transpose follows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import flash_block as fb

# Rows x head dim per program: no dot here, so any power of two would do. 4096 float32 (64 rows at
# D = 64, 32 at D = 128) keep the accumulator in registers, about 90 a thread with 4 warps.
BLOCK_ELEMENTS = 4096


def _combine_kernel(o_parts_ref, lse_parts_ref, o_ref, *lse_ref, block_rows, num_rows, num_parts, group):
    """Partials o_parts [P, rows, D], lse_parts [P, rows] of one (batch, KV head) -> o [T, Hq, D]
    (and lse [Hq, T] when asked) at this program's rows."""
    row0, row_ok, query, head = fb.query_rows(block_rows, num_rows, group)

    def part_lse(p):
        return plgpu.load(lse_parts_ref.at[p, pl.ds(row0, block_rows)], mask=row_ok, other=-jnp.inf)

    no_key = jnp.full((block_rows,), -jnp.inf, jnp.float32)
    top = lax.fori_loop(0, num_parts, lambda p, top: jnp.maximum(top, part_lse(p)), no_key)
    # Rows no slice saw keep top = -inf; shift them by 0 so every weight is e^-inf = 0, not NaN.
    shift = jnp.where(top == -jnp.inf, 0.0, top)

    def add_part(p, carry):
        acc, total = carry
        weight = jnp.exp(part_lse(p) - shift)
        o = plgpu.load(o_parts_ref.at[p, pl.ds(row0, block_rows), :], mask=row_ok[:, None], other=0.0)
        return acc + o * weight[:, None], total + weight

    empty = (jnp.zeros((block_rows, o_parts_ref.shape[-1]), jnp.float32), jnp.zeros((block_rows,), jnp.float32))
    acc, total = lax.fori_loop(0, num_parts, add_part, empty)
    seen = total > 0.0
    safe_total = jnp.where(seen, total, 1.0)
    fb.store_query_rows(o_ref, query, head, row_ok, acc / safe_total[:, None])
    if lse_ref:
        lse = jnp.where(seen, shift + jnp.log(safe_total), -jnp.inf)
        plgpu.store(lse_ref[0].at[head, query], lse, mask=row_ok)


@functools.partial(jax.jit, static_argnames=("num_queries", "out_dtype", "with_lse", "interpret"))
def combine_splits(o_parts, lse_parts, *, num_queries: int, out_dtype, with_lse: bool, interpret: bool):
    """Merges partials o [B, Hkv, P, T * G, D] float32 and lse [B, Hkv, P, T * G] over P.

    Rows are in flash_block's order (row t * G + g of KV head h is query t of head h * G + g).
    Returns o [B, T, Hq, D] in out_dtype and, with with_lse, lse float32 [B, Hq, T] (else None).
    """
    b, hkv, num_parts, rows, d = o_parts.shape
    group = rows // num_queries
    hq = hkv * group
    block_rows = fb.block_size(rows, BLOCK_ELEMENTS // d)
    kernel = functools.partial(_combine_kernel, block_rows=block_rows, num_rows=rows, num_parts=num_parts, group=group)
    out_specs = [pl.BlockSpec((None, num_queries, hq, d), lambda i, h, r: (i, 0, 0, 0))]
    out_shape = [jax.ShapeDtypeStruct((b, num_queries, hq, d), out_dtype)]
    if with_lse:
        out_specs.append(pl.BlockSpec((None, hq, num_queries), lambda i, h, r: (i, 0, 0)))
        out_shape.append(jax.ShapeDtypeStruct((b, hq, num_queries), jnp.float32))
    out = pl.pallas_call(
        kernel,
        grid=(b, hkv, pl.cdiv(rows, block_rows)),
        in_specs=[
            pl.BlockSpec((None, None, num_parts, rows, d), lambda i, h, r: (i, h, 0, 0, 0)),
            pl.BlockSpec((None, None, num_parts, rows), lambda i, h, r: (i, h, 0, 0)),
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="split_k_combine",
    )(o_parts, lse_parts)
    return (out[0], out[1]) if with_lse else (out[0], None)
