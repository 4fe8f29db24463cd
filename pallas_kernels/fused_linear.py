"""A projection for few rows with what surrounds it in a transformer layer fused in: an RMSNorm or
a SwiGLU before the product, a bias and a residual after it.

At a verify step a layer's projections see M = 1..128 rows (16-74 typically). XLA runs each as its
own GEMM (3.5-6.6 us on the H200 at 69 rows) and the RMSNorm statistics, the SwiGLU and the residual
add as further small kernels of ~1.5-2 us each, so a layer's projections take ~9 kernels. Here one
kernel per projection does it all, ~4 a layer:

- the grid is (row blocks, column tiles of N); each program holds its [rows, cols] tile of the
  product in float32 and walks K a chunk at a time (no split over K, so no second pass to sum
  partials). The weight is read once overall, the few rows of x once per column tile (from L2).
- RMSNorm needs a row's statistics before its first chunk enters the product, so a first pass over
  x's chunks sums the squares; the main loop then normalises each chunk in the order RMSNorm
  (longspec_jax.model) rounds it: float32 times rstd, cast to x's dtype, times the norm weight in
  x's dtype. The same rounding as the unfused layer, not merely the same value.
- SwiGLU reads the gate and up chunks of the same rows (x = gate | up) and feeds silu(gate) * up,
  computed in float32 and cast to x's dtype, to the product.
- bias and residual join the float32 tile before the one cast to x's dtype.

Triton's dots need every tile dim >= 16: the row block is padded to 16 and up with masked loads.
The block defaults below are reasoned from the H200's shape (SMs, shared memory), not yet timed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import flash_block as fb

# All of a verify step's rows (<= 128) in one block, so the weight is read once.
MAX_BLOCK_ROWS = 128
# Columns per program: 64, or 32 where 64 would leave fewer programs than the H200 has SMs
# (SmolLM2's N = 960 and 3,072 get 30 and 96 programs of 32; a 7B's 12,288 gets 192 of 64).
WIDE_BLOCK_COLS = 64
NARROW_BLOCK_COLS = 32
# Bytes of the x and weight chunks loaded per step of the loop over K: with three pipeline stages
# at most ~100 KiB of shared memory (Triton asks 12-61 KiB at SmolLM2's and a 7B's shapes), well
# under the H200's 227 KiB.
CHUNK_BYTES = 32 * 1024
MAX_BLOCK_K = 64


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def default_block_k(dim: int, x_rows: int, block_cols: int, itemsize: int, weight_itemsize: int | None = None) -> int:
    """The largest power of two dividing K (at most MAX_BLOCK_K) whose chunks of x [x_rows, chunk]
    and the weight [block_cols, chunk] (itemsize, or weight_itemsize where given) fit CHUNK_BYTES,
    at least the dot's minimum of 16."""
    row_bytes = x_rows * itemsize + block_cols * (itemsize if weight_itemsize is None else weight_itemsize)
    cap = max(fb.MIN_BLOCK, min(MAX_BLOCK_K, CHUNK_BYTES // row_bytes))
    chunk = fb.MIN_BLOCK
    while chunk * 2 <= cap and dim % (chunk * 2) == 0:
        chunk *= 2
    return chunk


def default_block_cols(num_cols: int, row_blocks: int) -> int:
    """WIDE_BLOCK_COLS if that gives every SM a program, else NARROW_BLOCK_COLS."""
    wide_programs = pl.cdiv(num_cols, WIDE_BLOCK_COLS) * row_blocks
    return WIDE_BLOCK_COLS if wide_programs >= fb.NUM_SMS else NARROW_BLOCK_COLS


def _kernel(*refs, norm, swiglu, scaled, has_bias, has_residual, eps, block_rows, block_cols, block_k):
    """x [M, K_in], weight [N, K], then weight_scale [N], norm_weight [K], bias [N], residual [M, N]
    where given, whole; writes this program's [rows, cols] tile of out [M, N]."""
    x_ref, w_ref, *refs, o_ref = refs
    scale_ref = refs.pop(0) if scaled else None
    norm_ref = refs.pop(0) if norm else None
    bias_ref = refs.pop(0) if has_bias else None
    residual_ref = refs.pop(0) if has_residual else None
    num_rows = x_ref.shape[0]
    num_cols, dim = w_ref.shape
    num_chunks = dim // block_k
    row0 = pl.program_id(0) * block_rows
    col0 = pl.program_id(1) * block_cols
    rows = pl.ds(row0, block_rows)
    cols = pl.ds(col0, block_cols)
    row_ok = row0 + jnp.arange(block_rows) < num_rows
    col_ok = col0 + jnp.arange(block_cols) < num_cols

    def k_chunk(start):
        return pl.ds(pl.multiple_of(start, block_k), block_k)

    def load_x(start):
        return plgpu.load(x_ref.at[rows, k_chunk(start)], mask=row_ok[:, None], other=0.0)

    if norm:

        def sum_squares(c, total):
            x = load_x(c * block_k).astype(jnp.float32)
            return total + jnp.sum(x * x, axis=1)

        total = lax.fori_loop(0, num_chunks, sum_squares, jnp.zeros((block_rows,), jnp.float32))
        rstd = lax.rsqrt(total / dim + eps)

    def accumulate(c, acc):
        start = c * block_k
        x = load_x(start)
        if norm:
            norm_w = plgpu.load(norm_ref.at[k_chunk(start)])
            x = norm_w[None, :] * (x.astype(jnp.float32) * rstd[:, None]).astype(x.dtype)
        elif swiglu:
            gate = x.astype(jnp.float32)
            up = load_x(dim + start).astype(jnp.float32)
            x = (gate * jax.nn.sigmoid(gate) * up).astype(x.dtype)
        w = plgpu.load(w_ref.at[cols, k_chunk(start)], mask=col_ok[:, None], other=0)
        if scaled:  # acc.T: the converted int8 chunk is the dot's first operand, taken from registers
            return acc + plgpu.dot(w.astype(x.dtype), x, trans_b=True, allow_tf32=False)
        return acc + plgpu.dot(x, w, trans_b=True, allow_tf32=False)

    shape = (block_cols, block_rows) if scaled else (block_rows, block_cols)
    out = lax.fori_loop(0, num_chunks, accumulate, jnp.zeros(shape, jnp.float32))
    if scaled:
        out = out.T * plgpu.load(scale_ref.at[cols], mask=col_ok, other=0.0)[None, :]
    if has_bias:
        out += plgpu.load(bias_ref.at[cols], mask=col_ok, other=0.0).astype(jnp.float32)[None, :]
    ok = row_ok[:, None] & col_ok[None, :]
    if has_residual:
        out += plgpu.load(residual_ref.at[rows, cols], mask=ok, other=0.0).astype(jnp.float32)
    plgpu.store(o_ref.at[rows, cols], out.astype(o_ref.dtype), mask=ok)


@functools.partial(
    jax.jit,
    static_argnames=("eps", "swiglu", "interpret", "block_rows", "block_cols", "block_k", "num_warps", "num_stages"),
)
def _fused_linear(
    x,
    weight,
    weight_scale,
    norm_weight,
    bias,
    residual,
    *,
    eps,
    swiglu,
    interpret,
    block_rows,
    block_cols,
    block_k,
    num_warps,
    num_stages,
):
    rows = x.shape[0]
    num_cols = weight.shape[0]
    kernel = functools.partial(
        _kernel,
        norm=norm_weight is not None,
        swiglu=swiglu,
        scaled=weight_scale is not None,
        has_bias=bias is not None,
        has_residual=residual is not None,
        eps=eps,
        block_rows=block_rows,
        block_cols=block_cols,
        block_k=block_k,
    )
    extras = [a for a in (weight_scale, norm_weight, bias, residual) if a is not None]
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(rows, block_rows), pl.cdiv(num_cols, block_cols)),
        out_shape=jax.ShapeDtypeStruct((rows, num_cols), x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="fused_linear",
    )(x, weight, *extras)


def _check(x, weight, weight_scale, norm_weight, swiglu, residual, bias) -> None:
    if x.ndim != 2 or weight.ndim != 2:
        raise ValueError(f"fused_linear: expected x [M, K_in] and weight [N, K], got {x.shape} and {weight.shape}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"fused_linear: x must have a float dtype, got {x.dtype}")
    if weight_scale is None and x.dtype != weight.dtype:
        raise ValueError(f"fused_linear: x and weight must share one float dtype, got {x.dtype}, {weight.dtype}")
    if weight_scale is not None and (
        weight.dtype != jnp.int8 or weight_scale.shape != weight.shape[:1] or weight_scale.dtype != jnp.float32
    ):
        raise ValueError(
            f"fused_linear: weight_scale must be float32 [N] = ({weight.shape[0]},) beside an int8 weight, got "
            f"{weight_scale.shape} {weight_scale.dtype} beside {weight.dtype}"
        )
    if x.shape[0] < 1:
        raise ValueError(f"fused_linear: x needs at least one row, got {x.shape}")
    num_cols, dim = weight.shape
    if norm_weight is not None and swiglu:
        raise ValueError("fused_linear: norm_weight and swiglu=True exclude each other (pick one prologue)")
    k_in = 2 * dim if swiglu else dim
    if x.shape[1] != k_in:
        what = "2 K (gate | up) with swiglu=True" if swiglu else "K"
        raise ValueError(f"fused_linear: x {x.shape} must have {what} = {k_in} columns for weight {weight.shape}")
    if dim % fb.MIN_BLOCK:
        raise ValueError(
            f"fused_linear: K = {dim} has no power-of-two divisor >= {fb.MIN_BLOCK} (the dot's least chunk); "
            f"K must be a multiple of {fb.MIN_BLOCK}"
        )
    if norm_weight is not None and (norm_weight.shape != (dim,) or norm_weight.dtype != x.dtype):
        raise ValueError(
            f"fused_linear: norm_weight must be [K] = ({dim},) in x's dtype {x.dtype}, got "
            f"{norm_weight.shape} {norm_weight.dtype}"
        )
    for name, array, shape in (("bias", bias, (num_cols,)), ("residual", residual, (x.shape[0], num_cols))):
        if array is not None and (array.shape != shape or not jnp.issubdtype(array.dtype, jnp.floating)):
            raise ValueError(
                f"fused_linear: {name} must be a float array of shape {shape}, got {array.shape} {array.dtype}"
            )


def fused_linear(
    x,
    weight,
    *,
    weight_scale=None,
    norm_weight=None,
    eps=1e-6,
    swiglu=False,
    residual=None,
    bias=None,
    interpret=None,
    block_rows=None,
    block_cols=None,
    block_k=None,
    num_warps=None,
    num_stages=None,
):
    """y = prologue(x) @ weight.T (+ bias) (+ residual).

    x [M, K_in]; weight [N, K] in the "out, in" layout (as longspec_jax.model.PackedLinear stores
    it), the same float dtype as x, or int8 with weight_scale float32 [N] (row n is weight[n] *
    weight_scale[n]: each chunk is converted to x's dtype, exact for |q| <= 127, and the float32
    product's columns are scaled before bias and residual). The prologue:
      - norm_weight [K] given (K_in == K, x's dtype): RMSNorm as longspec_jax.model.RMSNorm computes
        it: x32 = x.astype(f32); xn = (x32 * rsqrt(mean(x32**2, -1) + eps)).astype(x.dtype);
        xn = norm_weight * xn (in x.dtype);
      - swiglu=True (K_in == 2 K): x = gate | up (first K columns gate, last K up); the input is
        (silu(gate) * up) computed in float32 and cast to x.dtype;
      - neither: x itself. (norm_weight and swiglu together: ValueError.)
    The product accumulates in float32; bias [N] and residual [M, N] (any float dtype) are added in
    float32; the result is cast to x.dtype. K must be a multiple of 16. Block sizes (powers of two,
    block_rows and block_cols >= 16, block_k >= 16 dividing K) and Triton's num_warps / num_stages
    default to choices for the H200.
    """
    _check(x, weight, weight_scale, norm_weight, swiglu, residual, bias)
    rows = x.shape[0]
    num_cols, dim = weight.shape
    block_rows = fb.block_size(rows, MAX_BLOCK_ROWS) if block_rows is None else block_rows
    if block_cols is None:
        block_cols = default_block_cols(num_cols, pl.cdiv(rows, block_rows))
    if block_k is None:
        x_rows = 2 * block_rows if swiglu else block_rows
        block_k = default_block_k(dim, x_rows, block_cols, x.dtype.itemsize, weight.dtype.itemsize)
    for name, size in (("block_rows", block_rows), ("block_cols", block_cols), ("block_k", block_k)):
        if size < fb.MIN_BLOCK or not _is_power_of_two(size):
            raise ValueError(f"fused_linear: {name} must be a power of two >= {fb.MIN_BLOCK}, got {size}")
    if dim % block_k:
        raise ValueError(f"fused_linear: block_k {block_k} must divide K = {dim}")
    return _fused_linear(
        x,
        weight,
        weight_scale,
        norm_weight,
        bias,
        residual,
        eps=float(eps),
        swiglu=bool(swiglu),
        interpret=fb.default_interpret() if interpret is None else interpret,
        block_rows=block_rows,
        block_cols=block_cols,
        block_k=block_k,
        num_warps=4 if num_warps is None else num_warps,
        num_stages=3 if num_stages is None else num_stages,
    )
