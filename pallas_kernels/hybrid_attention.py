"""Hybrid tree attention in two kernels: T queries against the cache keys [0, cache_len[b]) (no
mask) and the N new keys under a mask, as one attention over both key sets.

The split-K cache kernel (cache_attention) already writes partial results that a combine kernel
merges; the new keys become one more partial. Grid (B, Hkv, row blocks, num_splits + 1): programs
with split index j < num_splits fold their slice of the cache as cache_attention does; the program
with j == num_splits folds the new keys under the mask, one key tile and its mask tile at a time
(as tree_attention). Rather than branch, every program runs both loops with bounds that leave one
of them empty, into the same online-softmax state. split_combine then merges the num_splits + 1
partials and writes o in q's layout. Against cache attention, masked attention and an LSE merge
done apart, this spares the masked kernel, the merge and the transposes around them.

`hybrid_attention_and_write` also writes the new keys into the caches at rows [cache_len[b],
cache_len[b] + N), the caches being outputs aliased to the inputs: AR decoding's one-token step then
needs no cache-write kernels of its own. No program reads what another writes: the cache slices
end at row cache_len[b] (masked loads past it touch no memory), and only the new-keys program of
row block 0 stores, the tiles it has just loaded to attend.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import cache_attention as split
from pallas_kernels import flash_block as fb
from pallas_kernels.split_combine import combine_splits


def _hybrid_kernel(
    len_ref,
    q_ref,
    k_ref,
    v_ref,
    k_new_ref,
    v_new_ref,
    mask_ref,
    o_ref,
    lse_ref,
    *cache_out_refs,
    scale,
    block_rows,
    block_keys,
    new_block_keys,
    group,
    num_rows,
    num_new,
    num_splits,
):
    """One row block of one (batch, KV head) against one cache slice, or (the last split index)
    against the new keys; with cache_out_refs (k, v [S, D], aliased to k_ref, v_ref), row block 0
    of the latter also stores the new keys at rows [cache_len, cache_len + N)."""
    row0, row_ok, query, head = fb.query_rows(block_rows, num_rows, group)
    q = fb.load_query_rows(q_ref, query, head, row_ok)
    j = pl.program_id(3)
    length = len_ref[()]
    writes = pl.program_id(2) == 0  # read outside the loop: the interpreter has no program ids inside one
    state = fb.empty_state(block_rows, q.shape[-1])
    # j == num_splits lies past every cache slice: the cache loop runs no iteration there.
    state = split.fold_cache_split(state, q, k_ref, v_ref, length, j, num_splits, block_keys, scale)

    def fold_new_tile(i, state):
        key0 = i * new_block_keys
        keys = key0 + jnp.arange(new_block_keys)
        key_ok = keys < num_new
        k = fb.load_rows(k_new_ref, key0, new_block_keys, key_ok)
        v = fb.load_rows(v_new_ref, key0, new_block_keys, key_ok)
        # The mask row of query t serves all G rows of t (mask_ref [T, N] int8).
        allowed = plgpu.load(
            mask_ref.at[query[:, None], keys[None, :]], mask=row_ok[:, None] & key_ok[None, :], other=0
        )
        if cache_out_refs:
            # Rows past the capacity are dropped, never written out of bounds.
            store_ok = key_ok & writes & (length + keys < k_ref.shape[0])
            for out_ref, rows in zip(cache_out_refs, (k, v)):
                plgpu.store(out_ref.at[pl.ds(length + key0, new_block_keys), :], rows, mask=store_ok[:, None])
        return fb.online_softmax_step(state, q, k, v, allowed != 0, scale)

    # Typed scalars: the Triton lowering gives a select's untyped literals the predicate's type (i1).
    new_tiles = jnp.where(j == num_splits, jnp.int32(pl.cdiv(num_new, new_block_keys)), jnp.int32(0))
    state = lax.fori_loop(0, new_tiles, fold_new_tile, state)
    fb.store_partial(o_ref, lse_ref, row0, row_ok, state)


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "interpret",
        "block_rows",
        "block_keys",
        "num_splits",
        "num_warps",
        "num_stages",
        "write_new",
    ),
)
def _hybrid_attention(
    q,
    k_cache,
    v_cache,
    cache_len,
    k_new,
    v_new,
    mask,
    *,
    scale,
    interpret,
    block_rows,
    block_keys,
    num_splits,
    num_warps,
    num_stages,
    write_new,
):
    """o [B,T,Hq,D], and with write_new the caches holding the new keys after row cache_len[b]."""
    b, t, _, d = q.shape
    n, hkv = k_new.shape[1], k_new.shape[2]
    group, rows, block_rows, row_blocks, num_splits = split.split_grid(q, k_cache, block_rows, block_keys, num_splits)
    kernel = functools.partial(
        _hybrid_kernel,
        scale=scale,
        block_rows=block_rows,
        block_keys=block_keys,
        new_block_keys=fb.block_size(n, block_keys),
        group=group,
        num_rows=rows,
        num_new=n,
        num_splits=num_splits,
    )
    mask_int8 = mask.astype(jnp.int8)  # Triton has no byte-addressable bool pointers
    in_specs, out_specs, out_shape = split.split_specs(q, k_cache, num_splits + 1, rows)
    in_specs += [
        pl.BlockSpec((None, n, None, d), lambda i, h, r, j: (i, 0, h, 0)),
        pl.BlockSpec((None, n, None, d), lambda i, h, r, j: (i, 0, h, 0)),
        pl.BlockSpec((None, t, n), lambda i, h, r, j: (i, 0, 0)),
    ]
    aliases = {}
    if write_new:
        # Inputs 2 and 3 (k_cache, v_cache) are outputs 2 and 3: updated in place, no copy.
        out_specs += in_specs[2:4]
        out_shape += [
            jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
            jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype),
        ]
        aliases = {2: 2, 3: 3}
    o_parts, lse_parts, *caches = pl.pallas_call(
        kernel,
        grid=(b, hkv, row_blocks, num_splits + 1),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="hybrid_split_k_attn_write" if write_new else "hybrid_split_k_attn",
    )(split.valid_lengths(cache_len, k_cache), q, k_cache, v_cache, k_new, v_new, mask_int8)
    o, _ = combine_splits(o_parts, lse_parts, num_queries=t, out_dtype=q.dtype, with_lse=False, interpret=interpret)
    return (o, *caches) if write_new else o


def _run(q, k_cache, v_cache, cache_len, k_new, v_new, mask, scale, interpret, write_new, **options):
    fb.check_grouped_shapes(q, k_cache, v_cache, "hybrid_attention")
    fb.check_grouped_shapes(q, k_new, v_new, "hybrid_attention")
    if k_new.shape[2] != k_cache.shape[2] or k_new.dtype != k_cache.dtype or v_new.dtype != v_cache.dtype:
        raise ValueError(
            f"hybrid_attention: new keys {k_new.shape} {k_new.dtype} must match the cache's KV heads and "
            f"dtype ({k_cache.shape}, {k_cache.dtype})"
        )
    if mask.shape != (q.shape[0], q.shape[1], k_new.shape[1]):
        raise ValueError(
            f"hybrid_attention: mask must be [B,T,N] = {(q.shape[0], q.shape[1], k_new.shape[1])}, got {mask.shape}"
        )
    if cache_len.shape != (q.shape[0],):
        raise ValueError(f"hybrid_attention: cache_len must be int32[B={q.shape[0]}], got {cache_len.shape}")
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    interpret = fb.default_interpret() if interpret is None else interpret
    return _hybrid_attention(
        q,
        k_cache,
        v_cache,
        cache_len,
        k_new,
        v_new,
        mask,
        scale=scale,
        interpret=interpret,
        write_new=write_new,
        **options,
    )


def hybrid_attention(
    q,
    k_cache,
    v_cache,
    cache_len,
    k_new,
    v_new,
    mask,
    *,
    scale=None,
    interpret=None,
    block_rows=128,
    block_keys=64,
    num_splits=None,
    num_warps=8,
    num_stages=3,
):
    """q [B,T,Hq,D] against cache keys [0, cache_len[b]) of k_cache, v_cache [B,S,Hkv,D] (no mask)
    plus new keys k_new, v_new [B,N,Hkv,D] where mask bool[B,T,N] is True: one attention over both.

    Returns o [B,T,Hq,D] in q.dtype; a row that sees no key at all gives 0. k_new must have
    k_cache's dtype. num_splits (of the cache; None picks it from the grid size), block_rows and
    block_keys (caps, powers of 2) as in cache_attention.
    """
    options = dict(
        block_rows=block_rows, block_keys=block_keys, num_splits=num_splits, num_warps=num_warps, num_stages=num_stages
    )
    return _run(q, k_cache, v_cache, cache_len, k_new, v_new, mask, scale, interpret, False, **options)


def hybrid_attention_and_write(
    q,
    k_cache,
    v_cache,
    cache_len,
    k_new,
    v_new,
    mask,
    *,
    scale=None,
    interpret=None,
    block_rows=128,
    block_keys=64,
    num_splits=None,
    num_warps=8,
    num_stages=3,
):
    """`hybrid_attention`, and the new keys written into the caches: returns (o, k_cache, v_cache)
    with rows [cache_len[b], cache_len[b] + N) of the caches holding k_new, v_new (rows past the
    capacity S are dropped) and every other row as it was. The caches are updated in place when
    the caller donates them (as a decode loop's carried state is)."""
    options = dict(
        block_rows=block_rows, block_keys=block_keys, num_splits=num_splits, num_warps=num_warps, num_stages=num_stages
    )
    return _run(q, k_cache, v_cache, cache_len, k_new, v_new, mask, scale, interpret, True, **options)
