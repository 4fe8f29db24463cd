"""Split-K attention over the KV cache on Hopper's own units (Pallas Mosaic GPU): TMA loads, wgmma.

The contract of cache_attention.cache_attention (T queries against the keys [0, cache_len[b]) of a
cache [B, S, Hkv, D], no mask; o and the natural-log lse back), for the 64-token verify of a 7B
model, where that Triton kernel is bound by its matrix work (Llama-3-8B's four query heads a KV
head: 256 query rows against each key) or reads its tiles slower (MHA).

A block is (query heads, slice of the sequence's keys, batch): one or two query heads of one KV
head's group (two where the group is even), each folded by its own compute warpgroup, and a third
warpgroup that issues the TMA copies of the slice's key and value tiles into a ring of
shared-memory slots that both compute warpgroups read. The two compute warpgroups take turns at the
tensor cores (a shared "schedule" barrier): while one runs its score product or its value product,
the other runs its softmax. The probabilities feed the value product from registers. The two blocks
of a group of four read the same tiles one after the other, mostly from the L2.

The slices are cut from the true length as split_combine.split_plan cuts them, so a sequence
that fills part of its cache loads only the tiles it holds; keys past the length inside a block's
last tile are masked (only that tile pays for the mask). A slice with no keys writes o = 0 and
lse = -inf, which the merge weighs 0. The partials are merged by split_combine's Triton kernel, each
query head's rows a group of their own.

A verify's tree (`block_mask`): the block's own keys, already written at cache rows [length,
length + 64), are one more tile of the first slice's ring, the OWN_ROWS rows from `own_tile_start`,
seen under a bias that XLA builds from the mask (`own_keys_bias`). The model's 64-token verify on
Hopper runs here where its blocks fill one wave (`attention.cache_on_hopper_units`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import flash_block as fb
from pallas_kernels.split_combine import combine_splits, split_plan

QUERY_ROWS = 64  # a wgmma tile's rows: the kernel takes exactly this many queries
OWN_ROWS = 128  # the tile that holds a block's own keys: 64 keys from any row, 64-row aligned
_LOG2E = math.log2(math.e)


def own_tile_start(length, capacity: int):
    """The first cache row of the tile that holds a block's own keys, rows [length, length + 64):
    length rounded down to 64 rows (TMA's tiles need aligned rows), and no further than the cache's
    last OWN_ROWS rows (the caller keeps length + 64 <= capacity, so the keys stay inside)."""
    return jnp.minimum(lax.div(length, 64) * 64, capacity - OWN_ROWS)


def own_keys_bias(block_mask, lengths, capacity: int):
    """bfloat16 [B, T, OWN_ROWS]: 0 where query t sees the own-keys tile's row (the block's key
    mask[b, t, j] at tile row j + length - own_tile_start), -inf elsewhere."""
    b, t, _ = block_mask.shape
    shift = lengths - own_tile_start(lengths, capacity)
    padded = jnp.pad(block_mask, ((0, 0), (0, 0), (0, OWN_ROWS - t)))
    seen = jax.vmap(lambda rows, n: jnp.roll(rows, n, axis=1))(padded, shift)
    return jnp.where(seen, 0.0, -jnp.inf).astype(jnp.bfloat16)


def supports(q, k_cache) -> bool:
    """Whether the kernel takes these operands: 64 queries, 16-bit, head dim a multiple of 64."""
    return (
        q.shape[1] == QUERY_ROWS
        and q.shape[-1] % 64 == 0
        and q.dtype in (jnp.bfloat16, jnp.float16)
        and k_cache.dtype == q.dtype
    )


def heads_per_block(q, k_cache) -> int:
    """Query heads a block folds: two of a group where the group is even, else one."""
    return 2 if (q.shape[2] // k_cache.shape[2]) % 2 == 0 else 1


def _kernel(
    len_ref, q_ref, k_ref, v_ref, bias_ref, o_ref, lse_ref, scoped, *, scale, pair, block_keys, stages, num_splits
):
    (q_smems, k_smem, v_smem, lse_smems, p_smems), (q_barriers, k_ready, v_ready), (k_free, v_free), turn = scoped
    heads, split, batch = lax.axis_index("heads"), lax.axis_index("split"), lax.axis_index("batch")
    wg = lax.axis_index("wg")
    group = q_ref.shape[2] // k_ref.shape[2]
    kv_head = lax.div(heads * pair, jnp.int32(group))
    length = len_ref[batch]
    num_tiles, per_split, _ = split_plan(length, num_splits, block_keys)
    first = split * per_split
    steps = jnp.maximum(jnp.minimum(first + per_split, num_tiles) - first, 0)
    # The first slice also folds the block's own keys (cache rows [length, length + T), under the
    # mask), as one more tile of the ring: the tile of OWN_ROWS rows from own_tile_start.
    own = bias_ref is not None
    total = steps + (jnp.where(split == 0, 1, 0) if own else 0)
    compute_regs, load_regs = _registers(pair)

    def take_turn():
        # Both compute warpgroups arrive; each waits for the other's arrival. They enter with one
        # phase between them, so the tensor-core work of one meets the softmax of the other.
        if pair == 2:
            plgpu.barrier_arrive(turn)
            plgpu.barrier_wait(turn)

    @pl.when(wg < pair)
    def _fold():
        plgpu.set_max_registers(compute_regs, action="increase")
        head = heads * pair + wg
        q_smem, lse_smem, q_barrier = q_smems.at[wg], lse_smems.at[wg], q_barriers.at[wg]
        plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(0, QUERY_ROWS), head], q_smem, q_barrier)
        plgpu.barrier_wait(q_barrier)
        rows = plgpu.Layout.WGMMA.reduce(1)
        m = plgpu.layout_cast(jnp.full((QUERY_ROWS,), -jnp.inf, jnp.float32), rows)
        l = plgpu.layout_cast(jnp.full((QUERY_ROWS,), 0.0, jnp.float32), rows)
        acc = plgpu.layout_cast(jnp.zeros((QUERY_ROWS, q_smem.shape[-1]), jnp.float32), plgpu.Layout.WGMMA)
        to_log2 = scale * _LOG2E

        @pl.when(total > 0)
        def _():
            plgpu.barrier_wait(k_ready.at[0])

        pl.when(wg == 1)(take_turn)

        def fold(carry, k_tile, v_tile, p_tile, *, visible, scores_read, values_ready, values_issued):
            """One key tile into the online softmax (m in log2 units). visible(s): s's scores in log2
            units, -inf where a key is not seen; the callbacks free and wait on the tile's slots."""
            acc, m, l = carry

            def scores(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, k_tile.transpose((1, 0)))
                take_turn()
                return acc_ref[...]

            s = pl.run_scoped(scores, plgpu.ACC((QUERY_ROWS, k_tile.shape[0]), jnp.float32))
            scores_read()
            s = visible(s)
            m_new = jnp.maximum(m, s.max(axis=1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row that has seen nothing yet
            alpha = jnp.exp2(m - m_safe)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_safe, s.shape, [0]))
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            l = l * alpha + p.sum(axis=1)
            p16 = p.astype(q_smem.dtype)
            acc, l, m_new, p16 = lax.optimization_barrier((acc, l, m_new, p16))
            if pair == 2:
                plgpu.barrier_arrive(turn)  # softmax done
            values_ready()
            if pair == 2:
                plgpu.barrier_wait(turn)  # the tensor cores are ours

            def values(acc_ref, p):
                plgpu.wgmma(acc_ref, p, v_tile)
                values_issued()

            if p_tile is None:  # the probabilities from registers, into the accumulator as it is
                acc = pl.run_state(lambda acc_ref: values(acc_ref, p16))(plgpu.ACC.init(acc))
            else:  # the interpreter: its wgmma reads both operands from shared memory
                p_tile[...] = p16
                plgpu.commit_smem()
                acc = acc + pl.run_scoped(
                    lambda acc_ref: (values(acc_ref, p_tile), acc_ref[...])[1],
                    plgpu.ACC(acc.shape, jnp.float32),
                )
            return acc, m_new, l

        def wait_next_keys(step):
            following = step + 1

            @pl.when(following < total)
            def _():
                plgpu.barrier_wait(k_ready.at[lax.rem(following, stages)])

        def fold_slot(step, carry, visible, values_issued):
            """The ring's tile of `step` into the online softmax, its slot freed after."""
            slot = lax.rem(step, stages)
            carry = fold(
                carry,
                k_smem.at[slot],
                v_smem.at[slot],
                None if p_smems is None else p_smems.at[wg],
                visible=visible,
                scores_read=lambda: plgpu.barrier_arrive(k_free.at[slot]),
                values_ready=lambda: plgpu.barrier_wait(v_ready.at[slot]),
                values_issued=values_issued,
            )
            plgpu.barrier_arrive(v_free.at[slot])
            return carry

        def fold_cache_tile(step, carry, masked):
            def visible(s):
                if masked:  # keys past the length in the block's last tile
                    key = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
                    s = jnp.where(key + (first + step) * block_keys < length, s, -jnp.inf)
                return s * to_log2

            return fold_slot(step, carry, visible, functools.partial(wait_next_keys, step))

        def fold_own_keys(step, carry):
            bias = plgpu.load(bias_ref.at[batch], layout=plgpu.Layout.WGMMA, optimized=False)
            return fold_slot(step, carry, lambda s: s * to_log2 + bias.astype(jnp.float32), lambda: None)

        # Every tile but the block's last holds keys below the length only.
        unmasked = jnp.maximum(steps - 1, 0)
        carry = lax.fori_loop(0, unmasked, functools.partial(fold_cache_tile, masked=False), (acc, m, l))
        carry = lax.fori_loop(unmasked, steps, functools.partial(fold_cache_tile, masked=True), carry)
        if own:
            carry = lax.fori_loop(steps, total, fold_own_keys, carry)
        acc, m, l = carry
        pl.when(wg == 0)(take_turn)

        held = l > 0
        inv = jnp.where(held, 1.0 / jnp.where(held, l, 1.0), 0.0)
        q_smem[...] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(q_smem.dtype)
        lse_smem[...] = jnp.where(held, (m + jnp.log2(jnp.where(held, l, 1.0))) / _LOG2E, -jnp.inf)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, o_ref.at[batch, head, split])
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[batch, head, split])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == pair)
    def _load():
        plgpu.set_max_registers(load_regs, action="decrease")

        def source(step):
            row = (first + step) * block_keys
            if own:  # the tile past the slice's cache tiles holds the block's own keys
                row = pl.multiple_of(jnp.where(step < steps, row, own_tile_start(length, k_ref.shape[1])), 64)
            return batch, pl.ds(row, block_keys), kv_head

        def fill(slot):
            plgpu.copy_gmem_to_smem(k_ref.at[source(slot)], k_smem.at[slot], k_ready.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[source(slot)], v_smem.at[slot], v_ready.at[slot])

        for slot in range(stages):
            pl.when(slot < total)(functools.partial(fill, slot))

        @pl.loop(0, jnp.maximum(total - stages, 0))
        def _refill(step):
            slot = lax.rem(step, stages)
            rows = source(step + stages)
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_ready.at[slot])
            plgpu.barrier_wait(v_free.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_ready.at[slot])

        # The last use of each slot is waited for too: every phase of a barrier is seen by the
        # warpgroup that waits on it, and the slots are idle when the kernel ends.
        def wait_free(slot):
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.barrier_wait(v_free.at[slot])

        for slot in range(stages):
            pl.when(slot < total)(functools.partial(wait_free, slot))


def _partials(q, k_cache, v_cache, lengths, bias, *, scale, num_splits, block_keys, stages, interpret):
    b, t, hq, d = q.shape
    pair = heads_per_block(q, k_cache)
    own = bias is not None
    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

    def entry(*refs):
        len_ref, q_ref, k_ref, v_ref = refs[:4]
        bias_ref = refs[4] if own else None
        o_ref, lse_ref = refs[-2:]
        pl.run_scoped(
            lambda *scoped: _kernel(
                len_ref,
                q_ref,
                k_ref,
                v_ref,
                bias_ref,
                o_ref,
                lse_ref,
                scoped,
                scale=scale,
                pair=pair,
                block_keys=block_keys,
                stages=stages,
                num_splits=num_splits,
            ),
            (
                plgpu.SMEM((pair, t, d), q.dtype, transforms=tiled),
                plgpu.SMEM((stages, block_keys, d), q.dtype, transforms=tiled),
                plgpu.SMEM((stages, block_keys, d), q.dtype, transforms=tiled),
                plgpu.SMEM((pair, t), jnp.float32),
                plgpu.SMEM((pair, t, block_keys), q.dtype, transforms=tiled) if interpret else None,
            ),
            (
                plgpu.Barrier(num_barriers=pair),
                plgpu.Barrier(num_barriers=stages),
                plgpu.Barrier(num_barriers=stages),
            ),
            (
                plgpu.Barrier(num_arrivals=pair, num_barriers=stages),
                plgpu.Barrier(num_arrivals=pair, num_barriers=stages),
            ),
            plgpu.Barrier(num_arrivals=pair),
            collective_axes="wg",
        )

    return plgpu.kernel(
        entry,
        out_type=(
            jax.ShapeDtypeStruct((b, hq, num_splits, t, d), q.dtype),
            jax.ShapeDtypeStruct((b, hq, num_splits, t), jnp.float32),
        ),
        grid=(hq // pair, num_splits, b),
        grid_names=("heads", "split", "batch"),
        num_threads=pair + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )(lengths, q, k_cache, v_cache, *([bias] if own else []))


def _registers(pair: int) -> tuple[int, int]:
    """Registers a thread of a compute warpgroup and of the loading one hold after `setmaxnreg`.

    The block starts with 64k registers split evenly over its pair + 1 warpgroups (whole multiples
    of 8 a thread); the loader gives most of its share back and the compute warpgroups take it. The
    shares must add up to no more than the start: an increase waits until the registers are free, so
    asking for more hangs the block (seen on the H200)."""
    warpgroups = pair + 1
    start = 65536 // (128 * warpgroups) // 8 * 8
    load = 40
    return min(232, (start * warpgroups - load) // pair // 8 * 8), load


def default_num_splits(q, k_cache, block_keys: int) -> int:
    """One wave of blocks (a block fills an SM's registers), no more slices than a full cache has
    tiles."""
    blocks = q.shape[0] * q.shape[2] // heads_per_block(q, k_cache)
    return max(1, min(fb.NUM_SMS // blocks, k_cache.shape[1] // block_keys))


@functools.partial(jax.jit, static_argnames=("scale", "num_splits", "block_keys", "stages", "interpret"))
def _cache_attention(q, k_cache, v_cache, cache_len, block_mask, *, scale, num_splits, block_keys, stages, interpret):
    lengths = jnp.minimum(cache_len.astype(jnp.int32), k_cache.shape[1])  # capped at the capacity
    bias = None if block_mask is None else own_keys_bias(block_mask, lengths, k_cache.shape[1])
    o_parts, lse_parts = _partials(
        q,
        k_cache,
        v_cache,
        lengths,
        bias,
        scale=scale,
        num_splits=num_splits,
        block_keys=block_keys,
        stages=stages,
        interpret=interpret,
    )
    # Each query head's partials are rows of their own: split_combine's kernel with a group of one.
    parts = jnp.full((q.shape[0],), num_splits, jnp.int32)
    return combine_splits(
        o_parts,
        lse_parts,
        parts,
        num_queries=q.shape[1],
        out_dtype=q.dtype,
        with_lse=True,
        interpret=interpret is not False,
    )


def cache_attention(
    q,
    k_cache,
    v_cache,
    cache_len,
    *,
    block_mask=None,
    scale=None,
    num_splits=None,
    block_keys=128,
    stages=2,
    interpret=False,
):
    """q [B,64,Hq,D] against the keys [0, cache_len[b]) of k_cache, v_cache [B,S,Hkv,D] (16-bit, D a
    multiple of 64, S a multiple of block_keys): (o [B,T,Hq,D] in q.dtype, lse float32 [B,Hq,T]).
    block_mask bool[B,T,T]: the queries' own block of keys, already in the cache at rows
    [cache_len[b], cache_len[b] + T) (the caller keeps that <= S), attended too where True (a verify's
    tree). interpret: False, or plgpu.InterpretGPUParams() to run on the CPU."""
    fb.check_grouped_shapes(q, k_cache, v_cache, "cache_attention_mgpu")
    if cache_len.shape != (q.shape[0],):
        raise ValueError(f"cache_attention_mgpu: cache_len must be int32[B={q.shape[0]}], got {cache_len.shape}")
    if not supports(q, k_cache):
        raise ValueError(
            f"cache_attention_mgpu: needs {QUERY_ROWS} queries, a 16-bit dtype and a head dim a multiple of 64; "
            f"got q {q.shape} {q.dtype}, cache {k_cache.dtype}"
        )
    if k_cache.shape[1] % block_keys:
        raise ValueError(f"cache_attention_mgpu: cache rows {k_cache.shape[1]} not a multiple of {block_keys}")
    t = q.shape[1]
    if block_mask is not None and block_mask.shape != (q.shape[0], t, t):
        raise ValueError(
            f"cache_attention_mgpu: block_mask must be bool[B,T,T] = {(q.shape[0], t, t)}, got {block_mask.shape}"
        )
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    if num_splits is None:
        num_splits = default_num_splits(q, k_cache, block_keys)
    return _cache_attention(
        q,
        k_cache,
        v_cache,
        cache_len,
        block_mask,
        scale=scale,
        num_splits=num_splits,
        block_keys=block_keys,
        stages=stages,
        interpret=interpret,
    )
