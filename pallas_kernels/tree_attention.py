"""Masked speculative attention ("fused_mask_attn"): T queries against N new keys under a mask.

In tree verification the N keys are the speculative tokens themselves (N = T' <= a few hundred), so
one program holds a block of query rows (all GQA heads of one KV head, see flash_block) and walks
the keys in tiles, loading the matching mask tile with each K/V tile (FlashAttention-2 order).

Grid: (B, Hkv, row blocks). The mask is expanded to one row per (query, head-in-group) outside the
kernel; it is tiny (B * T * G * N bytes) next to anything else the verify step moves.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import flash_block as fb


def _masked_kernel(q_ref, k_ref, v_ref, mask_ref, o_ref, lse_ref, *, scale, block_rows, block_keys, num_rows, num_keys):
    """One block of query rows of one (batch, KV head) against all N keys."""
    row0 = pl.program_id(2) * block_rows
    row_ok = row0 + jnp.arange(block_rows) < num_rows
    q = fb.load_rows(q_ref, row0, block_rows, row_ok)

    def fold_key_tile(i, state):
        key0 = i * block_keys
        key_ok = key0 + jnp.arange(block_keys) < num_keys
        k = fb.load_rows(k_ref, key0, block_keys, key_ok)
        v = fb.load_rows(v_ref, key0, block_keys, key_ok)
        allowed = plgpu.load(
            mask_ref.at[pl.ds(row0, block_rows), pl.ds(key0, block_keys)],
            mask=row_ok[:, None] & key_ok[None, :],
            other=0,
        )
        return fb.online_softmax_step(state, q, k, v, allowed != 0, scale)

    num_tiles = pl.cdiv(num_keys, block_keys)
    state = lax.fori_loop(0, num_tiles, fold_key_tile, fb.empty_state(block_rows, q.shape[-1]))
    o, lse = fb.finish_state(state)
    plgpu.store(o_ref.at[pl.ds(row0, block_rows), :], o.astype(o_ref.dtype), mask=row_ok[:, None])
    plgpu.store(lse_ref.at[pl.ds(row0, block_rows)], lse, mask=row_ok)


@functools.partial(
    jax.jit, static_argnames=("scale", "interpret", "block_rows", "block_keys", "num_warps", "num_stages")
)
def _masked_attention(q, k, v, mask, *, scale, interpret, block_rows, block_keys, num_warps, num_stages):
    b, t, hq, d = q.shape
    n, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    rows = t * g
    block_rows = fb.block_size(rows, block_rows)
    block_keys = fb.block_size(n, block_keys)
    q_rows = fb.group_query_rows(q, hkv)
    # Row t * G + g of the expanded mask is query t's row, as in q_rows; int8 because Triton has no
    # byte-addressable bool pointers.
    mask_rows = jnp.repeat(mask.astype(jnp.int8), g, axis=1)
    kernel = functools.partial(
        _masked_kernel, scale=scale, block_rows=block_rows, block_keys=block_keys, num_rows=rows, num_keys=n
    )
    o_rows, lse_rows = pl.pallas_call(
        kernel,
        grid=(b, hkv, pl.cdiv(rows, block_rows)),
        in_specs=[
            pl.BlockSpec((None, None, rows, d), lambda i, h, r: (i, h, 0, 0)),
            pl.BlockSpec((None, n, None, d), lambda i, h, r: (i, 0, h, 0)),
            pl.BlockSpec((None, n, None, d), lambda i, h, r: (i, 0, h, 0)),
            pl.BlockSpec((None, rows, n), lambda i, h, r: (i, 0, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, rows, d), lambda i, h, r: (i, h, 0, 0)),
            pl.BlockSpec((None, None, rows), lambda i, h, r: (i, h, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, hkv, rows, d), q.dtype),
            jax.ShapeDtypeStruct((b, hkv, rows), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="fused_mask_attn",
    )(q_rows, k, v, mask_rows)
    return fb.ungroup_output(o_rows, t), fb.ungroup_lse(lse_rows, t)


def masked_attention(
    q, k, v, mask, *, scale=None, interpret=None, block_rows=64, block_keys=64, num_warps=4, num_stages=2
):
    """Attention of q [B,T,Hq,D] over k, v [B,N,Hkv,D] where mask bool[B,T,N] is True.

    Returns (o [B,T,Hq,D] in q.dtype, lse float32 [B,Hq,T] = natural log of sum exp(scaled scores)).
    A fully masked row gives o = 0 and lse = -inf. block_rows / block_keys are caps (powers of 2);
    interpret defaults to True off GPU.
    """
    fb.check_grouped_shapes(q, k, v, "masked_attention")
    if mask.shape != (q.shape[0], q.shape[1], k.shape[1]):
        raise ValueError(
            f"masked_attention: mask must be [B,T,N] = {(q.shape[0], q.shape[1], k.shape[1])}, got {mask.shape}"
        )
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    interpret = fb.default_interpret() if interpret is None else interpret
    return _masked_attention(
        q,
        k,
        v,
        mask,
        scale=scale,
        interpret=interpret,
        block_rows=block_rows,
        block_keys=block_keys,
        num_warps=num_warps,
        num_stages=num_stages,
    )
