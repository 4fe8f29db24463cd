"""The draft's LM head and its top-k in one pass: the k best log-probs of hidden @ head.T per row,
without writing the [R, V] logits.

At a draft step the logits are [R, V] with R = 1..64 rows and V = 49k-128k tokens. As XLA ops the
head GEMM is followed by a log-softmax, a TopK and a sort, each its own kernel reading the logits
again, and XLA's GPU top-k costs several times the GEMM whatever the size. Here:

1. `_tile_kernel`, one program per (block of rows, tile of the vocabulary): the [rows, tile]
   logits in float32 (the head read once, a chunk of H at a time), then per row the tile's max m,
   its sum of e^(logit - m) and its top k, taken by k rounds of (max, lowest token id among the
   maxima, mask that token out).
2. `_merge_kernel`, one program per row: the row's logsumexp from the tiles' (m, sum) and the top k
   of the tiles' T * k candidates by the same rounds. Every winner is among its own tile's top k,
   and token ids are unique across tiles, so "lowest id among the maxima" again gives
   jax.lax.top_k's order: descending values, ties to the lower id. A second small kernel rather
   than XLA's top-k over the candidates, whose fixed cost on the GPU is itself tens of
   microseconds.

On the H200 at SmolLM2's head (49,152 x 576, bfloat16) the two kernels took 26-66 us for 1-64
rows against 56-215 us for XLA's GEMM, log-softmax and top-k: 1.2-3.2x the head's bytes floor
(`python -m benchmarks.bench_draft_top_k`; BENCHMARKS.md has the table).

With `noise` [G, V] (the rows in G equal groups, one noise row each) the k tokens chosen are the
best of logits + noise, and their values are logit + noise - logsumexp(logits): at zero noise the
log-probs, and with Gumbel noise the draft's side of a Gumbel race (a sampling tree's coupled
candidates, proposers.py). The softmax statistics never see the noise. The groups share a row
block: a batch's sequences (a group each) are one block of rows, so each head tile is loaded once
for all of them, and each row adds its own group's noise row to the tile's logits. The grid's
row-block axis varies fastest, so where rows span several blocks the programs that read the same
head tile run side by side and share it through the L2.

A tile with fewer than k tokens (the last one, when V is not a multiple of the tile) pads its
candidates with -inf, never chosen: there are V >= k finite logits ahead of them.

The head may be int8 with a float32 scale a row (`head_scale`, row v = head[v] * head_scale[v]),
half the bytes of a bfloat16 head (longspec_jax/draft_head.py chooses it). Hopper's matrix units
take int8 against int8 only, and converting the head to the hidden state's dtype in the kernel
(Triton loads the int8 operand two bytes at a time and repacks it) held the pass to ~2x the head's
bytes on the H200. So the hidden state goes in as int8 too, in two parts (`int8_parts`): rows
hidden ~ scale * (high + low / LOW_STEPS), ~16 bits of each row's largest entry. A tile multiplies
the int8 head chunk by each part on the matrix units (int32 sums, exact), and its float32 logits
are high + low / LOW_STEPS times the row's scale and the token's. The draft's candidates need not
be exact for the output to be; the parts' error is ~250 times smaller than the int8 head's own.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import flash_block as fb

# Rows per program: all of a draft step's rows (<= 64) in one block, so the head is read once.
MAX_BLOCK_ROWS = 64
# Tokens per program: 192 tiles for SmolLM2's 49,152 tokens, 501 for Llama-3's 128,256, enough to
# fill the H200's 132 SMs at one row block.
BLOCK_VOCAB = 256
# Bytes of the head chunk [tile, chunk of H] loaded per step of the loop over H: with three
# pipeline stages ~100 KB of shared memory, so two programs fit on an SM.
HEAD_CHUNK_BYTES = 32 * 1024
MAX_HEAD_CHUNK = 128
# An int8 product's chunk of H: Hopper's int8 matrix instructions take K in steps of 32.
INT8_MIN_CHUNK = 32
# The hidden state's second int8 part counts steps of 1 / LOW_STEPS of the first part's unit.
LOW_STEPS = 254


def parts_scale(peak):
    """The unit of `int8_parts`' high part for rows whose largest |entry| is peak: peak / 127, 1 for
    a row of zeros."""
    return jnp.where(peak > 0, peak / 127.0, 1.0)


def _parts_and_peak(hidden):
    """hidden [..., H] -> (high, low int8 [..., H], peak float32 [...]): `int8_parts` with each
    row's largest |entry| in place of its scale."""
    x = hidden.astype(jnp.float32)
    peak = jnp.max(jnp.abs(x), axis=-1)
    units = x / parts_scale(peak)[..., None]
    high = jnp.clip(jnp.round(units), -127, 127)
    low = jnp.clip(jnp.round((units - high) * LOW_STEPS), -127, 127)
    return high.astype(jnp.int8), low.astype(jnp.int8), peak


def int8_parts(hidden):
    """hidden [..., H] (float) -> (high, low int8 [..., H], scale float32 [...]) with
    hidden ~ scale * (high + low / LOW_STEPS): scale = `parts_scale` of the row's largest |entry|,
    high = round(hidden / scale), low the rest in steps of 1 / LOW_STEPS. The error is at most
    scale / (2 * LOW_STEPS), 2^-16 of the row's largest entry: as fine as bfloat16 at entries 2^8
    times smaller than it, finer above."""
    high, low, peak = _parts_and_peak(hidden)
    return high, low, parts_scale(peak)


def _power_of_two_at_least(n: int) -> int:
    size = 1
    while size < n:
        size *= 2
    return size


def head_chunk(dim: int, block_vocab: int, itemsize: int) -> int:
    """The largest power of two dividing H that keeps a [block_vocab, chunk] head chunk within
    HEAD_CHUNK_BYTES (at most MAX_HEAD_CHUNK, at least the dot's minimum of 16)."""
    cap = max(fb.MIN_BLOCK, min(MAX_HEAD_CHUNK, HEAD_CHUNK_BYTES // (block_vocab * itemsize)))
    chunk = fb.MIN_BLOCK
    while chunk * 2 <= cap and dim % (chunk * 2) == 0:
        chunk *= 2
    return chunk


def _top_k_rounds(scores, ids, k: int, slots: int, no_id: int):
    """The k largest of scores [..., N] along the last axis, ties to the lower id (ids [..., N],
    unique). Returns (values [..., slots], ids [..., slots]), slots >= k a power of two; the slots
    past k hold -inf and no_id."""
    slot = jnp.arange(slots)

    def round_(i, carry):
        scores, best_values, best_ids = carry
        best = jnp.max(scores, axis=-1, keepdims=True)
        best_id = jnp.min(jnp.where(scores == best, ids, no_id), axis=-1, keepdims=True)
        taken = slot == i
        return (
            jnp.where(ids == best_id, -jnp.inf, scores),
            jnp.where(taken, best, best_values),
            jnp.where(taken, best_id, best_ids),
        )

    lead = scores.shape[:-1]
    empty = (jnp.full((*lead, slots), -jnp.inf, jnp.float32), jnp.full((*lead, slots), no_id, jnp.int32))
    _, values, best_ids = lax.fori_loop(0, k, round_, (scores, *empty))
    return values, best_ids


def _tile_kernel(*refs, k, block_rows, block_vocab, chunk, per_group, scaled):
    """hidden [R, H] (scaled: its int8 parts high, low [R, H]), head [V, H], (scaled) head_scale [V]
    and the rows' largest |entry| [R] (their parts' `parts_scale`), (per_group) noise [G, V] with
    row r in group r // per_group, all whole; writes this program's tile of values, ids [R, T, k]
    and max, sum [R, T]."""
    refs = list(refs)
    hidden_refs = [refs.pop(0) for _ in range(2 if scaled else 1)]
    head_ref = refs.pop(0)
    scale_ref, peak_ref = (refs.pop(0), refs.pop(0)) if scaled else (None, None)
    noise_ref = refs.pop(0) if per_group else None
    values_ref, ids_ref, max_ref, sum_ref = refs
    num_rows, dim = hidden_refs[0].shape
    vocab = head_ref.shape[0]
    row0 = pl.program_id(0) * block_rows
    tile = pl.program_id(1)
    row = row0 + jnp.arange(block_rows)
    row_ok = row < num_rows
    token = tile * block_vocab + jnp.arange(block_vocab)
    token_ok = token < vocab
    tokens = pl.ds(tile * block_vocab, block_vocab)
    rows = (pl.ds(row0, block_rows),)

    def accumulate(c, sums):
        cols = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
        w = plgpu.load(head_ref.at[tokens, cols], mask=token_ok[:, None], other=0)
        parts = [plgpu.load(ref.at[(*rows, cols)], mask=row_ok[:, None], other=0) for ref in hidden_refs]
        if scaled:  # int8 by int8, int32 sums [tokens, rows]
            return tuple(total + plgpu.dot(w, part, trans_b=True) for total, part in zip(sums, parts))
        return (sums[0] + plgpu.dot(parts[0], w, trans_b=True, allow_tf32=False),)

    if scaled:
        zeros = jnp.zeros((block_vocab, block_rows), jnp.int32)
        high, low = lax.fori_loop(0, dim // chunk, accumulate, (zeros, zeros))
        logits = high.astype(jnp.float32) + low.astype(jnp.float32) * (1.0 / LOW_STEPS)
        row_scale = parts_scale(plgpu.load(peak_ref.at[rows], mask=row_ok, other=0.0))
        logits = logits.T * row_scale[:, None] * plgpu.load(scale_ref.at[tokens], mask=token_ok, other=0.0)[None, :]
    else:
        zeros = jnp.zeros((block_rows, block_vocab), jnp.float32)
        (logits,) = lax.fori_loop(0, dim // chunk, accumulate, (zeros,))
    logits = jnp.where(token_ok[None, :], logits, -jnp.inf)
    top = jnp.max(logits, axis=1)  # finite: every tile holds at least one token
    total = jnp.sum(jnp.exp(logits - top[:, None]), axis=1)
    plgpu.store(max_ref.at[(*rows, tile)], top, mask=row_ok)
    plgpu.store(sum_ref.at[(*rows, tile)], total, mask=row_ok)

    if per_group:
        if noise_ref.shape[0] == 1:  # one group: one noise row for every row
            noise = plgpu.load(noise_ref.at[pl.ds(0, 1), tokens], mask=token_ok[None, :], other=0.0)
        else:  # each row its group's noise row (the same few rows, from the L2)
            group = jnp.minimum(row // per_group, noise_ref.shape[0] - 1)
            noise = plgpu.load(
                noise_ref.at[group[:, None], token[None, :]], mask=row_ok[:, None] & token_ok[None, :], other=0.0
            )
        logits = logits + noise
    slots = _power_of_two_at_least(k)
    ids = jnp.broadcast_to(token[None, :], logits.shape)
    values, best_ids = _top_k_rounds(logits, ids, k, slots, vocab)
    out = (pl.ds(row0, block_rows), tile, pl.ds(0, slots))
    ok = row_ok[:, None] & (jnp.arange(slots) < k)[None, :]
    plgpu.store(values_ref.at[out], values, mask=ok)
    plgpu.store(ids_ref.at[out], best_ids, mask=ok)


def _merge_kernel(values_ref, ids_ref, max_ref, sum_ref, log_probs_ref, top_ids_ref, *, k, vocab):
    """One row: candidates values, ids [T * k] and the tiles' max, sum [T] -> log_probs, ids [k]."""
    num_candidates = values_ref.shape[0]
    num_tiles = max_ref.shape[0]
    width = _power_of_two_at_least(num_candidates)
    ok = jnp.arange(width) < num_candidates
    scores = plgpu.load(values_ref.at[pl.ds(0, width)], mask=ok, other=-jnp.inf)
    ids = plgpu.load(ids_ref.at[pl.ds(0, width)], mask=ok, other=vocab)

    tiles = _power_of_two_at_least(num_tiles)
    tile_ok = jnp.arange(tiles) < num_tiles
    tile_max = plgpu.load(max_ref.at[pl.ds(0, tiles)], mask=tile_ok, other=-jnp.inf)
    tile_sum = plgpu.load(sum_ref.at[pl.ds(0, tiles)], mask=tile_ok, other=0.0)
    top = jnp.max(tile_max)
    lse = top + jnp.log(jnp.sum(tile_sum * jnp.exp(tile_max - top)))

    slots = _power_of_two_at_least(k)
    values, best_ids = _top_k_rounds(scores, ids, k, slots, vocab)
    slot_ok = jnp.arange(slots) < k
    plgpu.store(log_probs_ref.at[pl.ds(0, slots)], values - lse, mask=slot_ok)
    plgpu.store(top_ids_ref.at[pl.ds(0, slots)], best_ids, mask=slot_ok)


@functools.partial(
    jax.jit, static_argnames=("k", "interpret", "block_rows", "block_vocab", "chunk", "num_warps", "num_stages")
)
def _head_top_k(
    hidden, head, head_scale, noise, *, k, interpret, block_rows, block_vocab, chunk, num_warps, num_stages
):
    rows = hidden.shape[0]
    vocab = head.shape[0]
    tiles = pl.cdiv(vocab, block_vocab)
    tile_kernel = functools.partial(
        _tile_kernel,
        k=k,
        block_rows=block_rows,
        block_vocab=block_vocab,
        chunk=chunk,
        per_group=None if noise is None else rows // noise.shape[0],
        scaled=head_scale is not None,
    )
    if head_scale is None:
        inputs = (hidden, head)
    else:
        # the kernel takes each row's peak and derives the scale itself: XLA then runs the parts as
        # two kernels (the peak, the parts), not three (a third for a scale both would read)
        high, low, peak = _parts_and_peak(hidden)
        inputs = (high, low, head, head_scale.astype(jnp.float32), peak)
    inputs += () if noise is None else (noise.astype(jnp.float32),)
    values, ids, tile_max, tile_sum = pl.pallas_call(
        tile_kernel,
        # row blocks first: the launch's fastest axis, so the blocks of one head tile run together
        grid=(pl.cdiv(rows, block_rows), tiles),
        out_shape=[
            jax.ShapeDtypeStruct((rows, tiles, k), jnp.float32),
            jax.ShapeDtypeStruct((rows, tiles, k), jnp.int32),
            jax.ShapeDtypeStruct((rows, tiles), jnp.float32),
            jax.ShapeDtypeStruct((rows, tiles), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="head_top_k_tiles",
    )(*inputs)

    per_row = lambda *shape: pl.BlockSpec((None, *shape), lambda r: (r,) + (0,) * len(shape))
    return pl.pallas_call(
        functools.partial(_merge_kernel, k=k, vocab=vocab),
        grid=(rows,),
        in_specs=[per_row(tiles * k), per_row(tiles * k), per_row(tiles), per_row(tiles)],
        out_specs=[per_row(k), per_row(k)],
        out_shape=[jax.ShapeDtypeStruct((rows, k), jnp.float32), jax.ShapeDtypeStruct((rows, k), jnp.int32)],
        compiler_params=plgpu.CompilerParams(num_warps=4 if tiles * k <= 2048 else 8, num_stages=1),
        interpret=interpret,
        name="head_top_k_merge",
    )(
        values.reshape(rows, tiles * k),
        ids.reshape(rows, tiles * k),
        tile_max.reshape(rows, tiles),
        tile_sum.reshape(rows, tiles),
    )


def _check(hidden, head, k, noise, head_scale) -> None:
    if hidden.ndim != 2 or head.ndim != 2:
        raise ValueError(f"head_top_k: expected hidden [R, H] and head [V, H], got {hidden.shape} and {head.shape}")
    if hidden.shape[1] != head.shape[1]:
        raise ValueError(f"head_top_k: hidden {hidden.shape} and head {head.shape} must share H")
    if not jnp.issubdtype(hidden.dtype, jnp.floating):
        raise ValueError(f"head_top_k: hidden must be floating point, got {hidden.dtype}")
    if head_scale is None and hidden.dtype != head.dtype:
        raise ValueError(f"head_top_k: hidden and head must share one float dtype, got {hidden.dtype}, {head.dtype}")
    if head_scale is not None and (head.dtype != jnp.int8 or head_scale.shape != head.shape[:1]):
        raise ValueError(
            f"head_top_k: head_scale [V] goes with an int8 head [V, H], got {head_scale.shape} and {head.dtype} "
            f"{head.shape}"
        )
    if hidden.shape[0] < 1:
        raise ValueError(f"head_top_k: hidden needs at least one row, got {hidden.shape}")
    if not 1 <= k <= head.shape[0]:
        raise ValueError(f"head_top_k: k must be in [1, V={head.shape[0]}], got {k}")
    if hidden.shape[1] % fb.MIN_BLOCK:
        raise ValueError(f"head_top_k: H must be a multiple of {fb.MIN_BLOCK} (the dot's chunk), got {hidden.shape[1]}")
    if noise is not None and (
        noise.ndim != 2 or noise.shape[1] != head.shape[0] or noise.shape[0] < 1 or hidden.shape[0] % noise.shape[0]
    ):
        raise ValueError(
            f"head_top_k: noise must be [G, V={head.shape[0]}] with G dividing the {hidden.shape[0]} rows, "
            f"got {noise.shape}"
        )


def head_top_k(
    hidden,
    head,
    k,
    *,
    head_scale=None,
    noise=None,
    interpret=None,
    block_rows=None,
    block_vocab=None,
    block_h=None,
    num_warps=None,
    num_stages=None,
):
    """hidden [R, H] (any float dtype, typically bfloat16), head [V, H] (same dtype; the LM head /
    tied embedding, rows = tokens), or int8 with head_scale float32[V] (row v is head[v] *
    head_scale[v]; hidden then enters as its `int8_parts`, H a multiple of 32).

    Returns (log_probs float32[R, k], ids int32[R, k]): the k largest entries of
    log_softmax(hidden @ head.T) per row, in descending order, ties to the lower token id (as
    jax.lax.top_k), computed with float32 accumulation. k is static. noise (optional, float32
    [G, V], G dividing R): row r's entries are ranked with noise[r // (R / G)] added, and come out
    as log-prob + noise (module doc). Block sizes (powers of two, block_rows >= 16; block_h, the
    features of H a step of the loop over H loads, >= 16 (32 over an int8 head) and dividing H: by
    default `head_chunk`'s) and Triton's num_warps / num_stages default to choices for the H200.
    """
    _check(hidden, head, k, noise, head_scale)
    block_rows = fb.block_size(hidden.shape[0], MAX_BLOCK_ROWS) if block_rows is None else block_rows
    block_vocab = BLOCK_VOCAB if block_vocab is None else block_vocab
    dim = hidden.shape[1]
    block_h = head_chunk(dim, block_vocab, head.dtype.itemsize) if block_h is None else block_h
    for name, size in (("block_rows", block_rows), ("block_vocab", block_vocab), ("block_h", block_h)):
        if size < fb.MIN_BLOCK or size & (size - 1):
            raise ValueError(f"head_top_k: {name} must be a power of two >= {fb.MIN_BLOCK}, got {size}")
    if dim % block_h:
        raise ValueError(f"head_top_k: block_h {block_h} must divide H = {dim}")
    if head_scale is not None and block_h < INT8_MIN_CHUNK:
        raise ValueError(
            f"head_top_k: an int8 head's products take H in chunks of at least {INT8_MIN_CHUNK} (the matrix "
            f"units' int8 step); got block_h {block_h} for H = {dim}: H must be a multiple of {INT8_MIN_CHUNK}"
        )
    if num_warps is None:  # a [64, 512] tile on 4 warps runs ~3x slower than on 8 (register spills)
        num_warps = 4 if block_rows * block_vocab <= 4096 else 8
    return _head_top_k(
        hidden,
        head,
        head_scale,
        noise,
        k=k,
        interpret=fb.default_interpret() if interpret is None else interpret,
        block_rows=block_rows,
        block_vocab=block_vocab,
        chunk=block_h,
        num_warps=num_warps,
        num_stages=3 if num_stages is None else num_stages,
    )
