"""A few rows times a large weight matrix on Hopper's own units (Pallas Mosaic GPU): the weight
streamed through TMA into a ring of shared-memory tiles, wgmma on 64 rows at a time.

A verify's 64 rows (or a draft level's 1-16, or an AR step's one, padded to 64) against a 7B
layer's weights is bound by reading the weights: at 64 rows the tensor cores need a fifth of the
time the bytes take. So a block here owns a strip of the weight's output columns (and optionally one
slice of its input features), and its only job is to keep enough of that strip in flight: a ring of
`stages` tiles of `tile_n` x 64 weight elements, each with the rows' matching 64 features, refilled
as soon as the tensor cores have read it. A strip's 64 x tile_n accumulator stays in registers; the
rows' tile is re-read from the L2 by every strip.

The weight is in the inference layout, [N, K] (out, in), K contiguous: its tiles feed wgmma as the
transposed right-hand side without a copy. With `splits` > 1 the K axis is cut into that many
slices, a block each, and the float32 partials are summed by XLA.

`benchmarks/bench_row_products.py` times it against XLA's products at 7B shapes (BENCHMARKS.md, "A
weight streamer for a few rows"); what decides its speed is how many weight bytes are in flight
across the GPU, so the knobs that win give ~100-130 blocks of eight slots each. The model runs it
for a verify's narrow products on Hopper GPUs (`longspec_jax/streamed_products.py`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

ROWS = 64  # a wgmma tile's rows: fewer rows are padded to this
TILE_K = 64  # 128 bytes of 16-bit features: one swizzled TMA row
SMEM_BYTES = 227 * 1024  # a Hopper block's shared memory
_TILED = (plgpu.TilingTransform((8, TILE_K)), plgpu.SwizzleTransform(128))


def supports(x, w) -> bool:
    """Whether the kernel takes these operands: x [M <= 64, K], w [N, K], one 16-bit dtype, K a
    multiple of 64."""
    return (
        x.ndim == 2
        and w.ndim == 2
        and x.shape[0] <= ROWS
        and x.shape[1] == w.shape[1]
        and x.shape[1] % TILE_K == 0
        and x.dtype in (jnp.bfloat16, jnp.float16)
        and w.dtype == x.dtype
    )


def _kernel(x_ref, w_ref, o_ref, *, tile_n, splits, stages):
    col, split = lax.axis_index("cols"), lax.axis_index("split")
    k = x_ref.shape[1] // splits
    columns = pl.ds(col * tile_n, tile_n)
    features = pl.ds(split * k, k)

    def product(acc_ref):
        def step(_, x_tile, w_tile):
            plgpu.wgmma(acc_ref, x_tile, w_tile.transpose((1, 0)))
            plgpu.wgmma_wait(1)  # the previous step's tiles are free once this one is issued

        plgpu.emit_pipeline(
            step,
            grid=(k // TILE_K,),
            in_specs=[
                plgpu.BlockSpec((ROWS, TILE_K), lambda kk: (0, kk), transforms=_TILED, delay_release=1),
                plgpu.BlockSpec((tile_n, TILE_K), lambda kk: (0, kk), transforms=_TILED, delay_release=1),
            ],
            max_concurrent_steps=stages,
        )(x_ref.at[:, features], w_ref.at[columns, features])
        plgpu.wgmma_wait(0)
        return acc_ref[...]

    acc = pl.run_scoped(product, plgpu.ACC((ROWS, tile_n), jnp.float32))

    def store(o_smem):
        o_smem[...] = acc.astype(o_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[split, :, columns])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(store, plgpu.SMEM((ROWS, tile_n), o_ref.dtype))


@functools.partial(jax.jit, static_argnames=("out_dtype", "tile_n", "splits", "stages", "partials", "interpret"))
def _row_matmul(x, w, *, out_dtype, tile_n, splits, stages, partials, interpret):
    m = x.shape[0]
    n = w.shape[0]
    rows = jnp.pad(x, ((0, ROWS - m), (0, 0)))
    part_dtype = out_dtype if splits == 1 else jnp.float32
    parts = plgpu.kernel(
        functools.partial(_kernel, tile_n=tile_n, splits=splits, stages=stages),
        out_type=jax.ShapeDtypeStruct((splits, ROWS, n), part_dtype),
        grid=(n // tile_n, splits),
        grid_names=("cols", "split"),
        interpret=interpret,
    )(rows, w)
    if partials:
        return parts
    return parts.sum(axis=0, dtype=jnp.float32).astype(out_dtype)[:m] if splits > 1 else parts[0, :m]


def row_matmul(x, w, *, out_dtype=None, tile_n=128, splits=1, stages=4, partials=False, interpret=False):
    """x [M, K] @ w[N, K]^T -> [M, N] in out_dtype (default x.dtype), float32 accumulation.
    M <= 64, 16-bit operands, K a multiple of 64 * splits, N a multiple of tile_n (a multiple of 8,
    at most 256). partials: return the kernel's output as it is, [splits, 64, N] (float32 partial
    sums over the slices of K, or the product in out_dtype when splits is 1; rows past M hold zeros,
    the padding's products), for a consumer that sums them itself. interpret: False, or
    plgpu.InterpretGPUParams() to run on the CPU."""
    if not supports(x, w):
        raise ValueError(
            f"row_matmul: needs x [M <= {ROWS}, K] and w [N, K] of one 16-bit dtype, K a multiple of {TILE_K}; "
            f"got x {x.shape} {x.dtype}, w {w.shape} {w.dtype}"
        )
    if not (8 <= tile_n <= 256 and tile_n % 8 == 0) or w.shape[0] % tile_n:
        raise ValueError(f"row_matmul: tile_n {tile_n} must be a multiple of 8 up to 256 dividing N = {w.shape[0]}")
    if splits < 1 or x.shape[1] % (TILE_K * splits):
        raise ValueError(f"row_matmul: K = {x.shape[1]} must split into {splits} slices of whole {TILE_K}s")
    slots = min(stages, x.shape[1] // splits // TILE_K)  # the pipeline holds no more than a slice's tiles
    ring = slots * (ROWS + tile_n) * TILE_K * x.dtype.itemsize
    if stages < 1 or ring > SMEM_BYTES:
        raise ValueError(
            f"row_matmul: a ring of {slots} slots of {tile_n}-column tiles takes {ring} bytes of shared memory, "
            f"more than the {SMEM_BYTES} a block has: fewer stages or narrower tiles"
        )
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    return _row_matmul(
        x, w, out_dtype=out_dtype, tile_n=tile_n, splits=splits, stages=stages, partials=partials, interpret=interpret
    )
