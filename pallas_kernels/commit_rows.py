"""The KV-cache commit after a tree verify, as one kernel for every cache array of every layer.

Row path[b, i] of each block array [B, T, H, D] goes to row lengths[b] + i (i < A) of its cache
array [B, S, H, D]. As XLA ops that is one dynamic-update-slice kernel per cache array (60 for a
30-layer model, K and V), each a few microseconds of launch for a few kilobytes moved; here one
kernel moves them all. The caches are aliased to the outputs, so they are updated in place: rows
outside [lengths[b], lengths[b] + A) keep their values and no cache-sized copy is made.

One program per (sequence, array): a program cannot choose a ref by a traced index, so program j
runs the copy of array j under pl.when(j == program_id), one static branch per array. Each copy
is one gathered [R, D'] tile, row r being (path row r // H, head r % H); R and D' are A * H and D
rounded up to powers of two (Triton tiles), the extra rows and columns masked off.

The start row is clamped to [0, S - A] as dynamic_update_slice clamps it, and path entries to
[0, T), as the XLA commit's gather clips them, so the two agree on every input.

Without block arrays (`blocks=None`) the rows move within the caches: row lengths[b] + path[b, i]
goes to row lengths[b] + i, the verified rows having been written at [lengths, lengths + T) by the
attention kernel. Rows a program reads are rows it may also write (lane i reads row lengths +
path[i], which lane path[i] writes), and the lanes of one program do not run in lockstep, so the
program loads its whole tile, waits at a barrier of all its threads, and only then stores: every
load sees the rows as they were before the commit, as the XLA gather-then-write does, whatever the
path (the tail past n_accept repeats node 0). The source row lengths + path[i] is clipped to
[0, S), as that gather clips it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import flash_block as fb


def _commit_kernel(path_ref, len_ref, *refs, num_arrays, num_path, block_rows, block_dim, in_cache, interpret):
    """refs: the block arrays [T, H, D] (none when in_cache), the caches as inputs (unread: they
    alias the outputs), then the cache outputs [S, H, D], each this program's sequence. in_cache:
    the rows come from the outputs themselves (the aliased caches)."""
    outs = refs[-num_arrays:]
    sources = outs if in_cache else refs[:num_arrays]
    num_new, heads, dim = sources[0].shape
    capacity = outs[0].shape[0]
    rows = jnp.arange(block_rows)
    cols = jnp.arange(block_dim)
    row_ok = rows < num_path * heads
    ok = row_ok[:, None] & (cols < dim)[None, :]
    step = lax.div(rows, heads)
    head = lax.rem(rows, heads)
    length = len_ref[()]
    node = plgpu.load(path_ref.at[step], mask=row_ok, other=0)
    src = jnp.clip(length + node, 0, capacity - 1) if in_cache else jnp.clip(node, 0, num_new - 1)
    start = jnp.clip(length, 0, capacity - num_path)
    # Masked-off rows (step >= A) aim at rows no lane writes, or past the cache: the interpreter's
    # masked store writes their old values back there (or drops them), the GPU leaves them alone.
    dst = start + step

    for j in range(num_arrays):

        @pl.when(pl.program_id(1) == j)
        def _copy(j=j):
            new = plgpu.load(sources[j].at[src[:, None], head[:, None], cols[None, :]], mask=ok, other=0)
            if in_cache and not interpret:  # the interpreter runs the load to its end before the store
                plgpu.debug_barrier()
            plgpu.store(outs[j].at[dst[:, None], head[:, None], cols[None, :]], new.astype(outs[j].dtype), mask=ok)


def _check_shapes(caches, blocks, path, lengths) -> None:
    if not caches or (blocks is not None and len(caches) != len(blocks)):
        got = "none" if blocks is None else len(blocks)
        raise ValueError(f"commit_rows: needs one block array per cache array, got {got} and {len(caches)}")
    cache = caches[0]
    if cache.ndim != 4 or any(c.shape != cache.shape or c.dtype != cache.dtype for c in caches):
        raise ValueError(f"commit_rows: cache arrays must all be [B,S,H,D] of one shape and dtype, got {cache.shape}")
    b, s, h, d = cache.shape
    if blocks is not None:
        block = blocks[0]
        if block.ndim != 4 or any(x.shape != block.shape for x in blocks):
            raise ValueError(f"commit_rows: block arrays must all be [B,T,H,D] of one shape, got {block.shape}")
        if (block.shape[0], block.shape[2], block.shape[3]) != (b, h, d):
            raise ValueError(
                f"commit_rows: block arrays {block.shape} must match the caches {cache.shape} in B, H and D"
            )
    if path.ndim != 2 or path.shape[0] != b or not 0 < path.shape[1] <= s:
        raise ValueError(f"commit_rows: path must be int32[B={b}, A] with 0 < A <= S={s}, got {path.shape}")
    if lengths.shape != (b,):
        raise ValueError(f"commit_rows: lengths must be int32[B={b}], got {lengths.shape}")


@functools.partial(jax.jit, static_argnames=("interpret",))
def _commit_rows(caches, blocks, path, lengths, *, interpret: bool):
    n = len(caches)
    b, s, h, d = caches[0].shape
    a = path.shape[1]
    in_cache = blocks is None
    blocks = () if in_cache else blocks
    kernel = functools.partial(
        _commit_kernel,
        num_arrays=n,
        num_path=a,
        block_rows=fb.block_size(a * h, a * h),
        block_dim=fb.block_size(d, d),
        in_cache=in_cache,
        interpret=interpret,
    )
    per_sequence = lambda rows: pl.BlockSpec((None, rows, h, d), lambda i, j: (i, 0, 0, 0))
    out = pl.pallas_call(
        kernel,
        grid=(b, n),
        in_specs=[
            pl.BlockSpec((None, a), lambda i, j: (i, 0)),
            pl.BlockSpec((None,), lambda i, j: (i,)),
            *[per_sequence(x.shape[1]) for x in blocks],
            *[per_sequence(s)] * n,
        ],
        out_specs=[per_sequence(s)] * n,
        out_shape=[jax.ShapeDtypeStruct(c.shape, c.dtype) for c in caches],
        input_output_aliases={2 + len(blocks) + j: j for j in range(n)},
        compiler_params=plgpu.CompilerParams(num_warps=2, num_stages=1),
        interpret=interpret,
        name="commit_rows_in_cache" if in_cache else "commit_rows",
    )(path.astype(jnp.int32), lengths.astype(jnp.int32), *blocks, *caches)
    return tuple(out)


def commit_rows(caches: Sequence, blocks: Sequence | None, path, lengths, *, interpret=None) -> tuple:
    """Writes row path[b, i] of blocks[j] [B,T,H,D] to row lengths[b] + i of caches[j] [B,S,H,D]
    for all i < A and every j; path int32[B, A], lengths int32[B]. Returns the new caches (in
    place when the caller's caches are not used afterwards); blocks are cast to the caches' dtype.
    blocks None: the rows come from the caches themselves, row lengths[b] + path[b, i] (the block
    already written at rows [lengths, lengths + T)), moved in place.

    The start row is clamped to S - A and path entries to [0, T) (source rows to [0, S) when in
    the caches), as the XLA ops clamp them.
    """
    caches = tuple(caches)
    blocks = None if blocks is None else tuple(blocks)
    _check_shapes(caches, blocks, path, lengths)
    interpret = fb.default_interpret() if interpret is None else interpret
    return _commit_rows(caches, blocks, path, lengths, interpret=interpret)
