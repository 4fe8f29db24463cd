"""A residual add and the RMSNorm after it, as one kernel for a few rows.

Between two products of a layer the model adds a product's output to the residual stream and
normalises the sum for the next product, whose matrix holds the norm's weight (`model.PackedLinear`):
h = x + delta, n = h * rsqrt(mean(h^2) + eps). For an AR step's or a verify's few rows XLA runs that
as three kernels (the add, the sum of squares, the scaling), each a few microseconds of launch for a
few kilobytes; here it is one. One program per row loads the row whole (its width rounded up to a
power of two, the extra lanes masked off), so h is read from registers, not memory, by the other two.

The rounding follows the model's: h is rounded to x's dtype, its statistics are taken in float32 from
that rounded h, and n is rounded once to x's dtype. delta may also come as a split product's partials
(`partials=True`: [S, R, H], e.g. the weight streamer's slices of K, rows past x's ignored), summed
here in float32 and rounded to x's dtype as the product's own output would be, so the kernel that
would have summed them is not run. With a weight (the model's final norm, whose
product is the LM head shared with the embedding, so the weight cannot live in a matrix) n is then
multiplied by it and rounded again, as `model.RMSNorm` does.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import flash_block as fb

# Row widths one program holds in registers: 8,192 float32 lanes of h are 64 registers a thread at
# 4 warps, beside x and delta's loads.
MAX_WIDTH = 8192


def _kernel(x_ref, delta_ref, *refs, width, block, eps, splits):
    weight_ref, h_ref, n_ref = refs if len(refs) == 3 else (None, *refs)
    cols = jnp.arange(block, dtype=jnp.int32)
    ok = cols < width
    x = plgpu.load(x_ref.at[cols], mask=ok, other=0).astype(jnp.float32)
    if splits is None:
        delta = plgpu.load(delta_ref.at[cols], mask=ok, other=0).astype(jnp.float32)
    else:  # a split product's partials: summed in float32, rounded as the product's output
        parts = [plgpu.load(delta_ref.at[s, cols], mask=ok, other=0).astype(jnp.float32) for s in range(splits)]
        delta = functools.reduce(jnp.add, parts).astype(h_ref.dtype).astype(jnp.float32)
    h = (x + delta).astype(h_ref.dtype)
    h32 = h.astype(jnp.float32)
    inverse_rms = jax.lax.rsqrt(jnp.sum(h32 * h32) / width + eps)
    plgpu.store(h_ref.at[cols], h, mask=ok)
    n = (h32 * inverse_rms).astype(n_ref.dtype)
    if weight_ref is not None:
        weight = plgpu.load(weight_ref.at[cols], mask=ok, other=0).astype(jnp.float32)
        n = (weight * n.astype(jnp.float32)).astype(n_ref.dtype)
    plgpu.store(n_ref.at[cols], n, mask=ok)


@functools.partial(jax.jit, static_argnames=("eps", "partials", "interpret"))
def _residual_norm(x, delta, weight, *, eps, partials, interpret):
    width = x.shape[-1]
    rows = x.reshape(-1, width)
    block = fb.block_size(width, MAX_WIDTH)
    row_spec = pl.BlockSpec((None, width), lambda r: (r, 0))
    if partials:
        splits = delta.shape[0]
        delta_spec = pl.BlockSpec((splits, None, width), lambda r: (0, r, 0))
    else:
        splits, delta, delta_spec = None, delta.reshape(rows.shape), row_spec
    inputs = (rows, delta) + (() if weight is None else (weight,))
    in_specs = [row_spec, delta_spec] + ([] if weight is None else [pl.BlockSpec((width,), lambda r: (0,))])
    h, n = pl.pallas_call(
        functools.partial(_kernel, width=width, block=block, eps=eps, splits=splits),
        grid=(rows.shape[0],),
        in_specs=in_specs,
        out_specs=[row_spec, row_spec],
        out_shape=[jax.ShapeDtypeStruct(rows.shape, x.dtype)] * 2,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="residual_norm",
    )(*inputs)
    return h.reshape(x.shape), n.reshape(x.shape)


def residual_norm(
    x: jax.Array,
    delta: jax.Array,
    eps: float,
    *,
    weight: jax.Array | None = None,
    partials: bool = False,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """x, delta [..., H] -> (h, n), both in x's dtype: h = x + delta, n = h * rsqrt(mean(h^2) + eps)
    (RMSNorm, statistics in float32), rounded, then times weight [H] and rounded again where given.
    partials: delta is [S, R, H], a split product's S partial sums (any float dtype) for R >= rows
    (x's leading dimensions multiplied; rows past them are not read), and delta is their float32
    sum rounded to x's dtype."""
    rows = math.prod(x.shape[:-1])
    if partials:
        if x.ndim < 1 or delta.ndim != 3 or delta.shape[1] < rows or delta.shape[2:] != x.shape[-1:]:
            raise ValueError(
                f"residual_norm: partials must be [S, R >= {rows}, H = {x.shape[-1]}] for x {x.shape}, "
                f"got {delta.shape}"
            )
    elif x.shape != delta.shape or x.ndim < 1:
        raise ValueError(f"residual_norm: x and delta must be [..., H] of one shape, got {x.shape} and {delta.shape}")
    if weight is not None and weight.shape != x.shape[-1:]:
        raise ValueError(f"residual_norm: weight must be [H] = ({x.shape[-1]},), got {weight.shape}")
    if x.shape[-1] > MAX_WIDTH:
        raise ValueError(f"residual_norm: rows of up to {MAX_WIDTH} features, got {x.shape[-1]}")
    if interpret is None:
        interpret = fb.default_interpret()
    weight = None if weight is None else weight.astype(x.dtype)
    delta = delta if partials else delta.astype(x.dtype)
    return _residual_norm(x, delta, weight, eps=float(eps), partials=partials, interpret=interpret)
