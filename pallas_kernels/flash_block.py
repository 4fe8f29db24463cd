"""Pieces shared by the Pallas attention kernels: query-row grouping and the online-softmax step.

The kernels give one program all query heads that share a KV head, so each K/V tile is loaded once
for the whole group. That makes a plain 2-D tile of rows: row t * G + g of KV head h is query t of
head h * G + g (G = Hq // Hkv), matching HF's repeat_kv grouping (query head h reads KV head h // G).
The split-K kernels read those rows straight from q [B, T, Hq, D] (query_rows); the masked kernel
takes them regrouped outside into [B, Hkv, T * G, D] (group_query_rows).

The online softmax (FlashAttention-2) keeps per row a running max m, a running sum l of 2^(s - m)
and an unnormalised output acc. Rows that have seen no visible key keep m = -inf; the step below
never subtracts -inf from -inf, so a fully masked row ends as o = 0, lse = -inf with no NaN.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# Triton's tensor-core dot needs every tile dim >= 16.
MIN_BLOCK = 16
SUPPORTED_HEAD_DIMS = (64, 128)
# The H200's streaming multiprocessors: programs of one wave where each takes an SM.
NUM_SMS = 132
LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)


def default_interpret() -> bool:
    """Kernels run compiled on GPU and in the Pallas interpreter everywhere else (CPU tests)."""
    return jax.default_backend() != "gpu"


def block_size(n: int, cap: int) -> int:
    """The power of two >= n (at least MIN_BLOCK), capped at cap: Triton tiles must be powers of 2."""
    size = MIN_BLOCK
    while size < n and size < cap:
        size *= 2
    return size


def check_grouped_shapes(q, k, v, what: str) -> None:
    """ValueError unless q [B,T,Hq,D], k/v [B,N,Hkv,D] agree and Hq is a multiple of Hkv."""
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
        raise ValueError(
            f"{what}: expected q [B,T,Hq,D] and k, v [B,N,Hkv,D] of equal shape; got "
            f"q {q.shape}, k {k.shape}, v {v.shape}"
        )
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"{what}: q {q.shape} and k {k.shape} must share batch and head dim")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"{what}: query heads ({q.shape[2]}) must be a multiple of KV heads ({k.shape[2]})")
    if q.shape[3] not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"{what}: the Pallas kernels support head dim {SUPPORTED_HEAD_DIMS}, got "
            f"{q.shape[3]}; use impl='xla' or 'cudnn'"
        )


def group_query_rows(q: jnp.ndarray, num_kv_heads: int) -> jnp.ndarray:
    """q [B, T, Hq, D] -> rows [B, Hkv, T * G, D], row t * G + g = query t of head kv * G + g."""
    b, t, hq, d = q.shape
    g = hq // num_kv_heads
    return q.reshape(b, t, num_kv_heads, g, d).transpose(0, 2, 1, 3, 4).reshape(b, num_kv_heads, t * g, d)


def ungroup_output(o_rows: jnp.ndarray, num_queries: int) -> jnp.ndarray:
    """rows [B, Hkv, T * G, D] -> [B, T, Hq, D] (inverse of group_query_rows)."""
    b, hkv, r, d = o_rows.shape
    g = r // num_queries
    return o_rows.reshape(b, hkv, num_queries, g, d).transpose(0, 2, 1, 3, 4).reshape(b, num_queries, hkv * g, d)


def ungroup_lse(lse_rows: jnp.ndarray, num_queries: int) -> jnp.ndarray:
    """rows [B, Hkv, T * G] -> [B, Hq, T]."""
    b, hkv, r = lse_rows.shape
    g = r // num_queries
    return lse_rows.reshape(b, hkv, num_queries, g).transpose(0, 1, 3, 2).reshape(b, hkv * g, num_queries)


def query_rows(block_rows: int, num_rows: int, group: int):
    """This program's block of query rows, for kernels whose grid is (B, Hkv, row blocks, ...).

    Returns (row0, row_ok bool [R], query int32 [R], head int32 [R]): row r of KV head h is query
    r // G of query head h * G + r % G, the order of group_query_rows. Reading q and writing o at
    (query, head) in their [T, Hq, D] layout spares the transposes group_query_rows and
    ungroup_output would cost as separate XLA kernels. Rows past num_rows have query >= T: always
    masked, never stored.
    """
    row0 = pl.program_id(2) * block_rows
    rows = row0 + jnp.arange(block_rows)
    query = lax.div(rows, group)
    head = pl.program_id(1) * group + lax.rem(rows, group)
    return row0, rows < num_rows, query, head


def _at_query_rows(ref, query, head):
    """ref [T, Hq, D] indexed at rows (query, head) -> a [R, D] view. Every index is an array (no
    slice): the Pallas interpreter gathers and scatters only such indexers."""
    return ref.at[query[:, None], head[:, None], jnp.arange(ref.shape[-1])[None, :]]


def load_query_rows(q_ref, query, head, row_ok):
    """The [R, D] tile of q_ref [T, Hq, D] at rows (query, head); rows not ok read as 0."""
    return plgpu.load(_at_query_rows(q_ref, query, head), mask=row_ok[:, None], other=0.0)


def store_query_rows(o_ref, query, head, row_ok, o):
    """Writes o [R, D] to o_ref [T, Hq, D] at rows (query, head), rows that are ok only."""
    plgpu.store(_at_query_rows(o_ref, query, head), o.astype(o_ref.dtype), mask=row_ok[:, None])


def load_rotated(ref, tokens, heads, cos_ref, sin_ref, ok):
    """Rows (tokens[r], heads[r]) of ref [T, H, D] rotated by RoPE rows tokens of cos_ref, sin_ref
    [T, D/2], in ref's dtype; rows not ok read as 0. As rope.rotate: out[:D/2] = x1 cos - x2 sin,
    out[D/2:] = x2 cos + x1 sin, in float32. Each element's partner (x2 for x1, x1 for x2) is a
    second load at shifted columns: Triton tiles cannot be split or joined along D."""
    d = ref.shape[-1]
    half = d // 2
    cols = jnp.arange(d, dtype=jnp.int32)
    partner_cols = lax.rem(cols + half, jnp.int32(d))
    freq_cols = lax.rem(cols, jnp.int32(half))
    rows_ok = ok[:, None]

    def load(indexed):
        return plgpu.load(indexed, mask=rows_ok, other=0.0).astype(jnp.float32)

    x = load(ref.at[tokens[:, None], heads[:, None], cols[None, :]])
    partner = load(ref.at[tokens[:, None], heads[:, None], partner_cols[None, :]])
    cos = load(cos_ref.at[tokens[:, None], freq_cols[None, :]])
    sin = load(sin_ref.at[tokens[:, None], freq_cols[None, :]])
    sign = jnp.where(cols < half, jnp.float32(-1.0), jnp.float32(1.0))
    return (x * cos + partner * sign[None, :] * sin).astype(ref.dtype)


def load_rows(ref, start, size: int, valid_rows):
    """A [size, D] tile of rows [start, start + size); rows outside valid_rows read as 0 (never NaN)."""
    return plgpu.load(ref.at[pl.ds(start, size), :], mask=valid_rows[:, None], other=0.0)


def empty_state(block_rows: int, head_dim: int):
    """(acc, m, l) for rows that have seen no key yet."""
    return (
        jnp.zeros((block_rows, head_dim), jnp.float32),
        jnp.full((block_rows,), -jnp.inf, jnp.float32),
        jnp.zeros((block_rows,), jnp.float32),
    )


def online_softmax_step(state, q, k, v, visible, scale: float):
    """Fold one key tile into (acc, m, l): q [R, D], k/v [N, D], visible bool [R, N].

    Scores are kept in base 2 (scaled by log2(e)): exp2 lowers to one fast hardware instruction,
    exp to a longer accurate sequence, and the exponentials are a visible share of the work here.
    """
    acc, m, l = state
    s = plgpu.dot(q, k, trans_b=True) * (scale * LOG2_E)
    s = jnp.where(visible, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    # A row with no visible key so far keeps m = -inf; shift it by 0 so exp2 gives 0, not NaN.
    shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    rescale = jnp.exp2(m - shift)
    p = jnp.exp2(s - shift[:, None])
    l = l * rescale + jnp.sum(p, axis=1)
    acc = acc * rescale[:, None] + plgpu.dot(p.astype(v.dtype), v)
    return acc, m_new, l


def finish_state(state):
    """(acc, m, l) -> (o float32 [R, D], lse float32 [R], natural log); rows with no visible key
    give 0 and -inf."""
    acc, m, l = state
    seen = l > 0.0
    o = acc / jnp.where(seen, l, 1.0)[:, None]
    lse = jnp.where(seen, (m + jnp.log2(jnp.where(seen, l, 1.0))) * LN_2, -jnp.inf)
    return o, lse


def store_partial(o_ref, lse_ref, slot, row0, row_ok, state) -> None:
    """Finishes state and writes it as partial `slot`: o float32 [R, D] at rows [row0, row0 + R) of
    o_ref [P, rows, D], lse at the same rows of lse_ref [P, rows]; rows not ok are not written."""
    o, lse = finish_state(state)
    size = row_ok.shape[0]
    plgpu.store(o_ref.at[slot, pl.ds(row0, size), :], o, mask=row_ok[:, None])
    plgpu.store(lse_ref.at[slot, pl.ds(row0, size)], lse, mask=row_ok)
