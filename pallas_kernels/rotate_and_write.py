"""RoPE and the cache-row writes of a block of new tokens, as one kernel.

From the model's q|k|v product qkv [B, T, Hq + 2 Hkv, D] (before RoPE) and RoPE's cos, sin
[B, T, D/2]: the rotated q comes out as [B, T, Hq, D], and the rotated k and the v of the T tokens
go to rows [lengths[b], lengths[b] + T) of the caches [B, S, Hkv, D], which are outputs aliased to
the inputs (updated in place when the caller donates them). As XLA ops that is three kernels: the
rotation, and one dynamic-update-slice per cache array (at batch > 1 a scatter, which also reads
the rows it writes). An attention kernel that reads the cache but cannot write it (the Mosaic GPU
verify, `cache_attention_mgpu`) runs after this one.

One program per (sequence, head of the product, block of tokens): a q head's program stores q, a k
head's the k cache, a v head's the v cache, each under its own pl.when (a program cannot choose a
ref by a traced index). Rows past the capacity S are dropped, as the fused Triton kernel drops
them (the caller keeps lengths + T <= S).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import flash_block as fb

# Tokens a program moves: 16 rows of a head keep the rotation's four [rows, D] float32 tiles
# (the row, its partner columns, cos, sin) at 16 registers a thread each, with 4 warps.
BLOCK_TOKENS = 16


def _kernel(len_ref, qkv_ref, cos_ref, sin_ref, _k_in, _v_in, q_ref, k_ref, v_ref, *, num_heads, num_tokens):
    """Tokens [j * BLOCK_TOKENS, (j + 1) * BLOCK_TOKENS) of head h of one sequence's product."""
    head = pl.program_id(1)
    tokens = pl.program_id(2) * BLOCK_TOKENS + jnp.arange(BLOCK_TOKENS, dtype=jnp.int32)
    ok = tokens < num_tokens
    heads = jnp.zeros((BLOCK_TOKENS,), jnp.int32) + head
    cols = jnp.arange(qkv_ref.shape[-1], dtype=jnp.int32)[None, :]
    num_kv_heads = k_ref.shape[1]
    rows = len_ref[()] + tokens
    in_cache = (ok & (rows < k_ref.shape[0]))[:, None]

    @pl.when(head < num_heads)
    def _():
        fb.store_query_rows(q_ref, tokens, heads, ok, fb.load_rotated(qkv_ref, tokens, heads, cos_ref, sin_ref, ok))

    @pl.when((head >= num_heads) & (head < num_heads + num_kv_heads))
    def _():
        k = fb.load_rotated(qkv_ref, tokens, heads, cos_ref, sin_ref, ok)
        plgpu.store(k_ref.at[rows[:, None], (heads - num_heads)[:, None], cols], k, mask=in_cache)

    @pl.when(head >= num_heads + num_kv_heads)
    def _():
        v = fb.load_query_rows(qkv_ref, tokens, heads, ok)
        plgpu.store(v_ref.at[rows[:, None], (heads - num_heads - num_kv_heads)[:, None], cols], v, mask=in_cache)


@functools.partial(jax.jit, static_argnames=("num_heads", "interpret"))
def _rotate_and_write(qkv, cos, sin, k_cache, v_cache, lengths, *, num_heads, interpret):
    b, t, heads, d = qkv.shape
    s, hkv = k_cache.shape[1:3]
    cache_spec = pl.BlockSpec((None, s, hkv, d), lambda i, h, j: (i, 0, 0, 0))
    return pl.pallas_call(
        functools.partial(_kernel, num_heads=num_heads, num_tokens=t),
        grid=(b, heads, pl.cdiv(t, BLOCK_TOKENS)),
        in_specs=[
            pl.BlockSpec((None,), lambda i, h, j: (i,)),
            pl.BlockSpec((None, t, heads, d), lambda i, h, j: (i, 0, 0, 0)),
            pl.BlockSpec((None, t, d // 2), lambda i, h, j: (i, 0, 0)),
            pl.BlockSpec((None, t, d // 2), lambda i, h, j: (i, 0, 0)),
            cache_spec,
            cache_spec,
        ],
        out_specs=[pl.BlockSpec((None, t, num_heads, d), lambda i, h, j: (i, 0, 0, 0)), cache_spec, cache_spec],
        out_shape=[
            jax.ShapeDtypeStruct((b, t, num_heads, d), qkv.dtype),
            jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
            jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype),
        ],
        # Inputs 4 and 5 (k_cache, v_cache) are outputs 1 and 2: written in place, no copy.
        input_output_aliases={4: 1, 5: 2},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="rotate_and_write_rows",
    )(lengths, qkv, cos, sin, k_cache, v_cache)


def supports(head_dim: int) -> bool:
    """Whether the kernel takes this head dim: a power of two (a Triton tile's columns)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def rotate_and_write(qkv, cos, sin, k_cache, v_cache, lengths, *, num_heads: int, interpret=None):
    """(q [B,T,Hq,D] rotated, k_cache, v_cache with the block's rotated k and its v at rows
    [lengths[b], lengths[b] + T)) from qkv [B,T,Hq + 2 Hkv,D] in the caches' dtype, cos, sin
    [B,T,D/2] (rope.rope_tables at the tokens' positions; rope.rotate's layout) and lengths int32[B].
    Every other cache row keeps its value."""
    b, t, heads, d = qkv.shape
    hkv = k_cache.shape[2]
    if heads != num_heads + 2 * hkv or qkv.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"rotate_and_write: qkv {qkv.shape} {qkv.dtype} must hold {num_heads} + 2 x {hkv} heads "
            f"in the caches' dtype ({k_cache.dtype}, {v_cache.dtype})"
        )
    if k_cache.shape != v_cache.shape or k_cache.shape[0] != b or k_cache.shape[3] != d or not supports(d):
        raise ValueError(
            f"rotate_and_write: caches {k_cache.shape}, {v_cache.shape} must be [B={b},S,Hkv,D={d}], D a power of two"
        )
    if cos.shape != (b, t, d // 2) or sin.shape != cos.shape:
        raise ValueError(f"rotate_and_write: cos, sin must be [B,T,D/2] = {(b, t, d // 2)}, got {cos.shape}")
    if lengths.shape != (b,):
        raise ValueError(f"rotate_and_write: lengths must be int32[B={b}], got {lengths.shape}")
    return _rotate_and_write(
        qkv,
        cos.astype(jnp.float32),
        sin.astype(jnp.float32),
        k_cache,
        v_cache,
        lengths.astype(jnp.int32),
        num_heads=num_heads,
        interpret=fb.default_interpret() if interpret is None else interpret,
    )
