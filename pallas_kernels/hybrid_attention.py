"""Hybrid tree attention in two kernels: T queries against the cache keys [0, cache_len[b]) (no
mask) and the N new keys under a mask, as one attention over both key sets.

The split-K cache kernel (cache_attention) already writes partial results that a combine kernel
merges; the new keys become one more partial. Grid (B, Hkv, row blocks, num_splits + 1): the program
with index j == 0 folds the new keys under the mask, one key tile and its mask tile at a time (as
tree_attention); those with j >= 1 fold slice j - 1 of the cache as cache_attention does. The new
keys come first because the GPU starts programs in the order of that last grid axis: a sequence that
fills part of a roomy cache leaves the high slices empty, and when the grid exceeds one wave of the
SMs (SmolLM2's 64-token verify at 32 splits: 198 programs, one an SM) the empty programs, started
one after another as SMs free up, had held back a new-keys program placed after them (timed on the
H200 with the new keys last, a 4.5k-token sequence's verify took 18.5 us a layer in an 8k-row cache
against 13.2 in a 5k-row one; with them first, 15.6 in the 8k rows;
cache_attention.default_num_splits now also keeps such a grid to one wave). Every program runs the
cache's loop, with bounds that leave it empty in the new keys' program, and the new keys' tiles
under a branch only that program takes, into the same online-softmax
state. The cache's slices that hold keys write their partials first (split_combine.split_plan),
the new keys' partial right after them; split_combine then merges those and writes o in q's layout.
Against cache attention, masked attention and an LSE merge done apart, this spares the masked
kernel, the merge and the transposes around them.

`hybrid_attention_and_write` is AR decoding's step in the same kernel: it takes the model's packed,
un-rotated q|k|v product and RoPE's cos/sin rows, rotates q and the new keys as it loads them, and
writes the new keys into the caches at rows [cache_len[b], cache_len[b] + N), the caches being
outputs aliased to the inputs. The step then needs no slice, rotation or cache-write kernels of
its own. No program reads what another writes: the cache slices end at row cache_len[b] (masked
loads past it touch no memory), and only the new-keys program of row block 0 stores, the tiles it
has just loaded to attend.
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
from pallas_kernels.split_combine import combine_splits, split_plan


def _hybrid_kernel(
    len_ref,
    q_ref,
    k_ref,
    v_ref,
    *refs,
    scale,
    block_rows,
    block_keys,
    new_block_keys,
    group,
    num_rows,
    num_new,
    num_splits,
    packed_heads,
):
    """One row block of one (batch, KV head) against one cache slice, or (split index 0) against
    the new keys.

    Plain: refs = (k_new, v_new [N, D], mask [T, N], o, lse). Packed (packed_heads = (Hq, Hkv)):
    q_ref is the q|k|v product [T, Hq + 2 Hkv, D] before RoPE, refs = (cos, sin [T, D/2], mask,
    o, lse, k_out, v_out [S, D] aliased to k_ref, v_ref); row block 0's new-keys program stores the
    rotated new keys and their values at rows [cache_len, cache_len + N)."""
    row0, row_ok, query, head = fb.query_rows(block_rows, num_rows, group)
    new_keys = pl.program_id(3) == 0
    # The new keys' program runs past every cache slice: its cache loop folds nothing.
    cache_split = jnp.where(new_keys, jnp.int32(num_splits), pl.program_id(3) - 1)
    length = jnp.minimum(len_ref[()], k_ref.shape[0])  # capped at the capacity
    # The cache's slices that hold keys write their partials first (split_plan), the new keys' right
    # after them, where the combine's count ends. A split past those has nothing to do: it loads no
    # query row and writes nothing.
    plan = split_plan(length, num_splits, block_keys)
    used = plan[2]
    rows_active = row_ok & (new_keys | (cache_split < used))
    if packed_heads:
        cos_ref, sin_ref, mask_ref, o_ref, lse_ref, *cache_out_refs = refs
        q = fb.load_rotated(q_ref, query, head, cos_ref, sin_ref, rows_active)
        num_heads, num_kv_heads = packed_heads
    else:
        k_new_ref, v_new_ref, mask_ref, o_ref, lse_ref = refs
        q = fb.load_query_rows(q_ref, query, head, rows_active)
    # Program ids are read outside the loop: the interpreter has none inside one.
    kv_head = pl.program_id(1)
    writes = pl.program_id(2) == 0
    state = fb.empty_state(block_rows, q.shape[-1])
    state = split.fold_cache_split(state, q, k_ref, v_ref, length, cache_split, plan, block_keys, scale)

    def fold_new_tile(i, state):
        key0 = i * new_block_keys
        keys = key0 + jnp.arange(new_block_keys)
        key_ok = keys < num_new
        if packed_heads:
            k_head = jnp.full((new_block_keys,), num_heads, jnp.int32) + kv_head
            k = fb.load_rotated(q_ref, keys, k_head, cos_ref, sin_ref, key_ok)
            cols = jnp.arange(q_ref.shape[-1])[None, :]
            v_rows = q_ref.at[keys[:, None], (k_head + num_kv_heads)[:, None], cols]
            v = plgpu.load(v_rows, mask=key_ok[:, None], other=0.0)
        else:
            # Rows by index arrays: key0 is a Python int here, and a static slice past N (masked
            # or not) is refused when the kernel is traced.
            cols = jnp.arange(k_new_ref.shape[-1])[None, :]
            k, v = (
                plgpu.load(ref.at[keys[:, None], cols], mask=key_ok[:, None], other=0.0)
                for ref in (k_new_ref, v_new_ref)
            )
        # The mask row of query t serves all G rows of t (mask_ref [T, N] int8).
        allowed = plgpu.load(
            mask_ref.at[query[:, None], keys[None, :]], mask=row_ok[:, None] & key_ok[None, :], other=0
        )
        if packed_heads:
            # Rows past the capacity are dropped, never written out of bounds.
            store_ok = key_ok & writes & (length + keys < k_ref.shape[0])
            for out_ref, rows in zip(cache_out_refs, (k, v)):
                plgpu.store(out_ref.at[pl.ds(length + key0, new_block_keys), :], rows, mask=store_ok[:, None])
        return fb.online_softmax_step(state, q, k, v, allowed != 0, scale)

    def fold_new_keys(state):
        # Unrolled, not a loop: Triton pipelines every loop that loads, and a second pipelined loop
        # beside the cache's doubled the shared memory its stages ask, which kept this kernel to two
        # stages at head dim 128 (see WRITE_KERNEL_STAGES).
        for i in range(pl.cdiv(num_new, new_block_keys)):
            state = fold_new_tile(i, state)
        return state

    state = lax.cond(new_keys, fold_new_keys, lambda state: state, state)
    fb.store_partial(o_ref, lse_ref, jnp.where(new_keys, used, cache_split), row0, rows_active, state)


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
        "packed_heads",
    ),
)
def _hybrid_attention(
    q,
    k_cache,
    v_cache,
    cache_len,
    new_a,
    new_b,
    mask,
    *,
    scale,
    interpret,
    block_rows,
    block_keys,
    num_splits,
    num_warps,
    num_stages,
    packed_heads,
):
    """Plain: q [B,T,Hq,D], (new_a, new_b) = (k_new, v_new) -> o. Packed (packed_heads = (Hq, Hkv)):
    q is the q|k|v product [B,T,Hq + 2 Hkv,D] before RoPE, (new_a, new_b) = (cos, sin) [B,T,D/2]
    -> (o, k_cache, v_cache)."""
    b, t, _, d = q.shape
    hkv = k_cache.shape[2]
    if packed_heads:
        n, queries = t, jax.ShapeDtypeStruct((b, t, packed_heads[0], d), q.dtype)
    else:
        n, queries = new_a.shape[1], q
    group, rows, block_rows, row_blocks, num_splits = split.split_grid(
        queries, k_cache, block_rows, block_keys, num_splits, extra_parts=1
    )
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
        packed_heads=packed_heads,
    )
    mask_int8 = mask.astype(jnp.int8)  # Triton has no byte-addressable bool pointers
    lengths = cache_len.astype(jnp.int32)  # each kernel caps them at the capacity: no XLA kernel does
    in_specs, out_specs, out_shape = split.split_specs(queries, k_cache, num_splits + 1, rows)
    aliases = {}
    if packed_heads:
        in_specs[1] = pl.BlockSpec((None, t, q.shape[2], d), lambda i, h, r, j: (i, 0, 0, 0))
        in_specs += [pl.BlockSpec((None, t, d // 2), lambda i, h, r, j: (i, 0, 0))] * 2
        # Inputs 2 and 3 (k_cache, v_cache) are outputs 2 and 3: updated in place, no copy.
        out_specs += in_specs[2:4]
        out_shape += [jax.ShapeDtypeStruct(c.shape, c.dtype) for c in (k_cache, v_cache)]
        aliases = {2: 2, 3: 3}
    else:
        in_specs += [pl.BlockSpec((None, n, None, d), lambda i, h, r, j: (i, 0, h, 0))] * 2
    in_specs.append(pl.BlockSpec((None, t, n), lambda i, h, r, j: (i, 0, 0)))
    o_parts, lse_parts, *caches = pl.pallas_call(
        kernel,
        grid=(b, hkv, row_blocks, num_splits + 1),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="hybrid_split_k_attn_write" if packed_heads else "hybrid_split_k_attn",
    )(lengths, q, k_cache, v_cache, new_a, new_b, mask_int8)
    o, _ = combine_splits(
        o_parts,
        lse_parts,
        lengths,
        num_queries=t,
        out_dtype=q.dtype,
        with_lse=False,
        interpret=interpret,
        cut=(num_splits, block_keys, 1, k_cache.shape[1]),  # the new keys' partial after the cache's
    )
    return (o, *caches) if packed_heads else o


def _check_mask_and_lengths(mask, cache_len, b, t, n):
    if mask.shape != (b, t, n):
        raise ValueError(f"hybrid_attention: mask must be [B,T,N] = {(b, t, n)}, got {mask.shape}")
    if cache_len.shape != (b,):
        raise ValueError(f"hybrid_attention: cache_len must be int32[B={b}], got {cache_len.shape}")


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
    fb.check_grouped_shapes(q, k_cache, v_cache, "hybrid_attention")
    fb.check_grouped_shapes(q, k_new, v_new, "hybrid_attention")
    if k_new.shape[2] != k_cache.shape[2] or k_new.dtype != k_cache.dtype or v_new.dtype != v_cache.dtype:
        raise ValueError(
            f"hybrid_attention: new keys {k_new.shape} {k_new.dtype} must match the cache's KV heads and "
            f"dtype ({k_cache.shape}, {k_cache.dtype})"
        )
    _check_mask_and_lengths(mask, cache_len, q.shape[0], q.shape[1], k_new.shape[1])
    return _hybrid_attention(
        q,
        k_cache,
        v_cache,
        cache_len,
        k_new,
        v_new,
        mask,
        scale=float(q.shape[-1] ** -0.5 if scale is None else scale),
        interpret=fb.default_interpret() if interpret is None else interpret,
        block_rows=block_rows,
        block_keys=block_keys,
        num_splits=num_splits,
        num_warps=num_warps,
        num_stages=num_stages,
        packed_heads=None,
    )


# Pipeline stages of the rotating kernel's cache loop. With the new keys' tiles in a loop of their
# own too, Triton pipelined both and three stages at head dim 128 asked an H200 for more shared
# memory than it has, so that head dim ran two; with those tiles under a branch three fit, and on
# the H200 (`python -m benchmarks.bench_cache_attention --verify-configs ...`, 2026-12-04) a 64-token
# verify at 32k cached keys took 172 against 189 us a layer at Vicuna-7B's shape, 137 against 216
# at Llama-3-8B's (128-row blocks on 8 warps and two stages before).
WRITE_KERNEL_STAGES = 3
# Query rows (tokens x GQA group) up to which a small head dim's kernel runs 64-row blocks on 4
# warps. On the H200 at SmolLM2's shape (head dim 64, group 3, 4.5k cached keys; `python -m
# benchmarks.tune_decode_attention`) this was 10-15 % faster per layer than 128 rows on 8 warps
# for 1, 11 and 25 tokens, and no choice beat the default at 69 tokens (207 rows).
SMALL_BLOCK_MAX_ROWS = 128
# At head dim 128 every block runs at most 64 rows on 4 warps: on the H200 a 64-token tree at 32k
# cached keys took 172 against 231 us a layer with 128 rows on 8 warps at Vicuna-7B's shape (no
# GQA: a half-empty tile), 137 against 164 at Llama-3-8B's (256 rows a KV head); 8 warps on 64 rows
# took 217-230. The AR step's 1-4 rows (a 16-row tile) ran 1-2 % faster on 4 warps than on 8.
WIDE_HEAD_BLOCK_ROWS = 64


def _write_kernel_blocks(rows: int, head_dim: int) -> tuple[int, int]:
    """(block_rows, num_warps) of the rotating kernel for `rows` query rows."""
    if head_dim > 64:
        return WIDE_HEAD_BLOCK_ROWS, 4
    if rows <= SMALL_BLOCK_MAX_ROWS:
        return 64, 4
    return 128, 8


def hybrid_attention_and_write(
    qkv,
    cos,
    sin,
    k_cache,
    v_cache,
    cache_len,
    mask,
    *,
    num_heads,
    scale=None,
    interpret=None,
    block_rows=None,
    block_keys=64,
    num_splits=None,
    num_warps=None,
    num_stages=None,
):
    """A block whose new keys are its own tokens (AR decoding's one-token step), straight from the
    model's q|k|v product: qkv [B,T,Hq + 2 Hkv,D] (q heads, then k, then v; no RoPE yet, in the
    caches' dtype), cos, sin float32 [B,T,D/2] (rope.rope_tables at the tokens' positions).

    Rotates q and k (rope.rotate's layout), attends as `hybrid_attention` with N = T (new key i is
    token i) and writes the rotated k and v of the T tokens at rows [cache_len[b], cache_len[b] + T)
    of the caches (rows past the capacity S are dropped; every other row stays as it was). Returns
    (o [B,T,Hq,D] in qkv.dtype, k_cache, v_cache); the caches are updated in place when the caller
    donates them (as a decode loop's carried state is). block_rows, num_warps and num_stages left
    None are chosen for the shape (`_write_kernel_blocks`, `WRITE_KERNEL_STAGES`)."""
    b, t, heads, d = qkv.shape
    hkv = k_cache.shape[2]
    queries = jax.ShapeDtypeStruct((b, t, num_heads, d), qkv.dtype)
    fb.check_grouped_shapes(queries, k_cache, v_cache, "hybrid_attention_and_write")
    if heads != num_heads + 2 * hkv or qkv.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"hybrid_attention_and_write: qkv {qkv.shape} {qkv.dtype} must hold {num_heads} + 2 x {hkv} heads "
            f"in the caches' dtype ({k_cache.dtype}, {v_cache.dtype})"
        )
    if cos.shape != (b, t, d // 2) or sin.shape != cos.shape:
        raise ValueError(f"hybrid_attention_and_write: cos, sin must be [B,T,D/2] = {(b, t, d // 2)}, got {cos.shape}")
    _check_mask_and_lengths(mask, cache_len, b, t, t)
    default_rows, default_warps = _write_kernel_blocks(t * (num_heads // hkv), d)
    return _hybrid_attention(
        qkv,
        k_cache,
        v_cache,
        cache_len,
        cos.astype(jnp.float32),
        sin.astype(jnp.float32),
        mask,
        scale=float(d**-0.5 if scale is None else scale),
        interpret=fb.default_interpret() if interpret is None else interpret,
        block_rows=default_rows if block_rows is None else block_rows,
        block_keys=block_keys,
        num_splits=num_splits,
        num_warps=default_warps if num_warps is None else num_warps,
        num_stages=WRITE_KERNEL_STAGES if num_stages is None else num_stages,
        packed_heads=(num_heads, hkv),
    )
