"""The target decoder (Llama family and Qwen2) in Flax NNX, its static KV cache and `commit`.

Layout: linear kernels are `[in, out]`; the embedding (and a separate LM head) are `[V, H]`.
Every layer owns its own parameter arrays and the layers run in a Python loop: stacked layers
indexed inside a device loop get copied every step (docs/GPU_NOTES.md), per-layer arrays do not.
Activations run in the parameter dtype; RMSNorm statistics, softmax and logits in float32.
Attention math lives in `attention.py`; this file only projects, rotates and stores K/V.

`Transformer.inference_layout()` packs each layer's q/k/v and gate/up projections into one matrix
each, stored `[out, in]` (for a GPU, products of 1-3 rows are written as a multiply and a float32
sum over each weight row's contiguous memory, which XLA keeps as one reduction kernel instead of a
GEMM and the reduction of its split-K partials: `SMALL_ROWS`; on a Hopper GPU a verified block's
narrow 7B products stream their weight through a Mosaic GPU kernel instead: `streamed_products`),
and every forward computes RoPE's cos/sin once for all layers: a small model's decode step costs
about one launch per kernel, not its bytes (docs/GPU_NOTES.md), so fewer, larger kernels decode
faster.
A one-token `forward_block` (AR decoding) writes its K/V row and attends the cache in one call
(with the Pallas kernels, one kernel and its combine: no cache-write kernels). A larger block (tree
verification) attends the cache rows before it plus its own K/V; `commit` then keeps only the
accepted rows. With the Pallas kernels the block goes the AR step's way: one kernel per layer
rotates, attends and writes the block's K/V past the cache end (no slice or rotation kernels), and
`commit` moves the accepted rows down within the cache in one kernel; in the one-token step of one
sequence, and in a verified block whose products stream their weight, each residual add and the
norm after it are one kernel (`residual_norm`). With
`fused_projections` set, each layer's projections (of a block and of the one-token step) run as
fused Pallas kernels too (`fused_linear`: the norms in the q|k|v and gate|up products' prologues,
SwiGLU in the down product's, the residual adds in their epilogues). Otherwise (not "pallas") the
block's K/V come back as arrays (`BlockKV`) and `commit` writes the accepted rows from them, one
write per cache array.

The cache holds keys after RoPE, so a block forward never re-rotates the prefix. Every length is
an array, so one compiled program serves all prompt lengths of the same padded shape.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx, struct

from longspec_jax import attention
from longspec_jax.config import ModelConfig
from longspec_jax.errors import UserError
from longspec_jax.int8_rows import quantized_rows
from longspec_jax.rope import inverse_frequencies, rope_tables, rotate
from longspec_jax.streamed_products import streamer_knobs
from pallas_kernels import flash_block, row_matmul_mgpu
from pallas_kernels.commit_rows import commit_rows
from pallas_kernels.fused_linear import fused_linear
from pallas_kernels.residual_norm import residual_norm

INIT_STD = 0.02
# Row counts (tokens x batch) whose packed products run as multiply-reduce on a GPU: on the H200 a
# 30-layer chain of SmolLM2's products took 0.426 ms at 2 rows against 0.630 as GEMMs (one row:
# 0.398); at 4 rows the two tie and from 8 rows on the GEMMs win (BENCHMARKS.md, products by row
# count). At one row XLA already reduced SmolLM2's products so; a 7B's it ran as a split-K GEMM and
# a kernel summing the partials, three a layer, which the reduction spares: the AR step 3.7-5.7 %
# faster on an H100 (BENCHMARKS.md, "One-row products as reductions"). On a CPU the reduction is
# twice as slow as the dot at any row count, so it is GPU-only.
SMALL_ROWS = (1, 2, 3)
# Past one row the reduction walks the whole weight once a row (XLA reduces row 0's outputs before
# row 1's): a Llama-3-8B product at 2 / 3 rows took 2.1-2.3x / 3.0-3.3x its bytes as multiply-reduce
# against 1.1-1.5x as XLA's GEMM on an H100 (`bench_row_products --reduction`; BENCHMARKS.md,
# "Products of 2-3 rows"). A weight of at most SMALL_ROWS_MAX_BYTES (SmolLM2's largest is 3.5 MB) is
# read again from the L2 cache; a larger one takes the GEMM at 2-3 rows.
SMALL_ROWS_MAX_BYTES = 8 << 20
# A product with a folded norm (`PackedLinear`) scales its float32 output rows instead of its input
# from SCALE_AFTER_ROWS rows on, where its input has at most SCALE_AFTER_MAX_WIDTH features. There,
# a verified block's q|k|v and gate|up products are split-K GEMMs whose reduction kernel takes the
# scale along: SmolLM2's 64-row round runs one kernel a layer fewer (compiled for the H200: 533 ->
# 503 for the default tree), 1.5 % faster on an H100. An AR step's 1-8 rows have no such kernel and
# normalise first (scaling after added one a layer at batch 4: 298 -> 342 kernels). At 7B widths the
# round is bound by bytes, and the float32 outputs cost more than a kernel: scaling after made
# the verify 2-3 % slower on an H100 (BENCHMARKS.md, "Norms folded into the products").
SCALE_AFTER_ROWS = 16
SCALE_AFTER_MAX_WIDTH = 1024


def multiply_reduce(x: jax.Array, w: jax.Array, dtype) -> jax.Array:
    """x [..., K] times w [N, K] as a multiply and a float32 sum over each weight row, in `dtype`:
    the form of `SMALL_ROWS`' products, one reduction kernel on a GPU."""
    return jnp.sum(x[..., None, :].astype(jnp.float32) * w.astype(jnp.float32), axis=-1).astype(dtype)


def reduces(rows: int, small_rows: Sequence[int], weight: jax.Array) -> bool:
    """Whether a product of `rows` rows against `weight` [N, K] runs as `multiply_reduce`: `rows` is
    one of `small_rows`, and past one row the weight is small enough to be re-read from the L2 cache
    (`SMALL_ROWS_MAX_BYTES`)."""
    return rows in small_rows and (rows == 1 or weight.size * weight.dtype.itemsize <= SMALL_ROWS_MAX_BYTES)


def norms_first(rows: int, width: int) -> bool:
    """Whether a folded norm scales a product's input (else its output rows): `SCALE_AFTER_ROWS`."""
    return rows < SCALE_AFTER_ROWS or width > SCALE_AFTER_MAX_WIDTH


# How a product over int8 rows (`PackedLinear.to_int8`: a 7B draft's block) runs on a GPU:
# "xla", XLA's GEMM reading the int8 rows (timed in rounds: BENCHMARKS.md, "The draft's block as
# int8 too"), or "kernel", `fused_linear`'s int8 path for at most INT8_KERNEL_MAX_ROWS rows, in
# tiles of INT8_BLOCK_COLS output columns walking K INT8_BLOCK_K at a time through INT8_STAGES
# pipeline stages. Timed on an H100, the two gave the same Llama-3-8B round (BENCHMARKS.md, "The
# draft's int8 products on a kernel of ours against XLA's"), so XLA's stays the default;
# `bench_speculative --int8-products xla,kernel` and `bench_row_products --int8` time both.
INT8_PRODUCTS = "xla"
INT8_KERNEL_MAX_ROWS = 64
INT8_BLOCK_COLS = 32
INT8_BLOCK_K = 256
INT8_STAGES = 4


def int8_kernel_settings(dim: int) -> dict:
    """`fused_linear`'s settings for a product over int8 rows with K = dim."""
    return dict(block_cols=INT8_BLOCK_COLS, block_k=math.gcd(dim, INT8_BLOCK_K), num_stages=INT8_STAGES)


def int8_kernel_knobs(rows: int, dim: int) -> dict | None:
    """`int8_kernel_settings` where a product over int8 rows of `rows` rows runs as `fused_linear`
    (INT8_PRODUCTS "kernel", on a GPU, at most INT8_KERNEL_MAX_ROWS rows: a draft level's nodes),
    else None (XLA's product)."""
    if INT8_PRODUCTS != "kernel" or rows > INT8_KERNEL_MAX_ROWS or flash_block.default_interpret():
        return None
    return int8_kernel_settings(dim)


def small_rows_for(platform: str) -> tuple[int, ...]:
    """The inference layout's small-row products on a device of this platform ("gpu" / "cuda" / "cpu")."""
    return SMALL_ROWS if platform in ("gpu", "cuda") else ()


Rope = tuple[jax.Array, jax.Array]  # (cos, sin) of `rope.rope_tables`, shared by every layer


@struct.dataclass
class KVCache:
    """Static KV cache. k, v: one `[B, S_max, Hkv, D]` array per layer (k after RoPE);
    lengths: int32[B], the tokens held per sequence (rows past it hold anything)."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]


@struct.dataclass
class BlockKV:
    """Where the K/V of `forward_block`'s T tokens are: one `[B, T, Hkv, D]` array per layer in k
    (after RoPE) and v, or k = v = None when they are in the cache itself, at rows
    [lengths[b], lengths[b] + T) of every layer (past its end: not part of the sequence yet).
    `commit` writes the accepted rows from either into place."""

    k: tuple[jax.Array, ...] | None
    v: tuple[jax.Array, ...] | None

    @property
    def in_cache(self) -> bool:
        return self.k is None


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype) -> KVCache:
    """An empty cache of `max_len` rows (static) per sequence."""
    shape = (batch, max_len, config.num_kv_heads, config.head_dim)
    per_layer = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))
    return KVCache(k=per_layer(), v=per_layer(), lengths=jnp.zeros((batch,), jnp.int32))


def commit(cache: KVCache, block: BlockKV, path: jax.Array, n_accept: jax.Array, *, impl: str = "xla") -> KVCache:
    """Write a verified block's accepted rows at the cache end: row `path[b, i]` of the block goes to
    cache row `lengths[b] + i` (all i < A, in every layer), then `lengths += n_accept`.
    block: `forward_block`'s K/V of the block; path: int32[B, A]; n_accept: int32[B] (<= A).

    impl "pallas" moves every layer's rows in one Pallas kernel, the caches updated in place; XLA
    spends a kernel per cache array. A block in the cache (what `forward_block` returns under
    "pallas") always takes the kernel: its rows move from cache row `lengths[b] + path[b, i]`.
    Rows past the new lengths get whatever the path's tail names (they hold anything). The caller
    keeps lengths + A <= S_max (`attention.write_cache_rows`)."""
    lengths = cache.lengths + n_accept.astype(jnp.int32)
    if impl == "pallas" or block.in_cache:
        layers = len(cache.k)
        blocks = None if block.in_cache else (*block.k, *block.v)
        try:
            rows = commit_rows((*cache.k, *cache.v), blocks, path, cache.lengths)
        except ValueError as err:  # shapes the kernel cannot take: the caller's to fix
            raise UserError(str(err)) from err
        return cache.replace(k=rows[:layers], v=rows[layers:], lengths=lengths)
    pick = jax.vmap(lambda rows, p: jnp.take(rows, p, axis=0, mode="clip"))

    def write(x, new):  # a small gather that XLA can fuse into the write's update
        return attention.write_cache_rows(x, pick(new, path), cache.lengths)

    return cache.replace(
        k=tuple(write(x, new) for x, new in zip(cache.k, block.k)),
        v=tuple(write(x, new) for x, new in zip(cache.v, block.v)),
        lengths=lengths,
    )


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], dtype) -> jax.Array:
    # Drawn directly in the target dtype on the default device: no float32 copy at 7B size.
    return jax.random.normal(rngs.params(), shape, dtype) * jnp.asarray(INIT_STD, dtype)


class Linear(nnx.Module):
    """y = x @ kernel (+ bias); kernel [in, out]."""

    def __init__(self, d_in: int, d_out: int, *, bias: bool, dtype, rngs: nnx.Rngs):
        self.kernel = nnx.Param(_normal(rngs, (d_in, d_out), dtype))
        self.bias = nnx.Param(jnp.zeros((d_out,), dtype)) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = x @ self.kernel[...]
        return y if self.bias is None else y + self.bias[...]


class PackedLinear(nnx.Module):
    """One or several `Linear`s of the same input as one matmul, for inference: weight
    [sum of outs, in], the transposed ("out, in") layout. A one-row product against it reduces over
    each weight row's contiguous memory in one kernel on the GPU; against the training layout
    [in, out] it wrote and re-read a weight-sized temporary (BENCHMARKS.md, one-token
    matrix-vector products). `parts(x)` returns each Linear's output, in order.
    small_rows: the row counts (all dimensions of x but the last, multiplied) whose product is
    written as an elementwise product and a float32 sum over the input (`SMALL_ROWS` on a GPU).

    norm: the RMSNorm before these products, folded in: its weight multiplies the matrix's input
    columns once, here, and a call takes the un-normalised x. Its statistics (float32) then scale
    either x before the product or the product's float32 rows after it (`SCALE_AFTER_ROWS`); both
    equal norm-then-product up to rounding, since rsqrt(mean(x^2)) is one number per row.

    `to_int8()` stores the weight as int8 rows with a float32 scale each (`int8_rows`), for a
    draft's products, which need not be exact: the product converts the rows to x's dtype (exact for
    |q| <= 127; XLA reads the int8 matrix inside its GEMM) and scales its float32 output columns."""

    def __init__(self, parts: Sequence[Linear], small_rows: Sequence[int] = (), norm: RMSNorm | None = None):
        self.small_rows = tuple(small_rows)
        weight = jnp.concatenate([p.kernel[...].T for p in parts], axis=0)
        if norm is not None:
            weight = weight * norm.weight[...].astype(weight.dtype)[None, :]  # one rounding of each product
        self.weight = nnx.Param(weight)
        self.weight_scale = nnx.data(None)  # a float32 scale a row once `to_int8` made the weight int8
        self.eps = None if norm is None else norm.eps
        self.bias = None if parts[0].bias is None else nnx.Param(jnp.concatenate([p.bias[...] for p in parts]))
        ends = [0]
        for p in parts:
            ends.append(ends[-1] + p.kernel.shape[1])
        self.split_at = tuple(ends[1:-1])

    def __call__(self, x: jax.Array, normed: jax.Array | None = None) -> jax.Array:
        """normed: x under the folded norm (without its weight), where a kernel already made it
        (`residual_norm`, only where `norms_first`); the product then reads it instead of x."""
        w = self.weight[...]
        rows = math.prod(x.shape[:-1])
        scale = None
        if normed is not None:
            if self.eps is None or not norms_first(rows, x.shape[-1]):
                raise ValueError("a normed input is only for a product whose folded norm scales its input")
            x = normed
        elif self.eps is not None:
            x32 = x.astype(jnp.float32)
            scale = inverse_rms(x32, self.eps)
            if norms_first(rows, x.shape[-1]):
                x, scale = (x32 * scale).astype(x.dtype), None
        if self.weight_scale is not None and self.eps is None and (knobs := int8_kernel_knobs(rows, w.shape[1])):
            flat = fused_linear(
                x.reshape(rows, -1), w, weight_scale=self.weight_scale[...], bias=_value(self.bias), **knobs
            )
            return flat.reshape(*x.shape[:-1], w.shape[0])
        if self.weight_scale is not None:  # int8 rows: the columns' scales join the rows' after the product
            w = w.astype(x.dtype)
            scale = self.weight_scale[...] if scale is None else scale * self.weight_scale[...]
        out = x.dtype if scale is None else jnp.float32
        if reduces(rows, self.small_rows, self.weight[...]):
            y = multiply_reduce(x, w, out)
        elif self.weight_scale is None and (streamed := self._streamed(rows, x, w)) is not None:
            flat = row_matmul_mgpu.row_matmul(x.reshape(rows, x.shape[-1]), w, out_dtype=out, **streamed)
            y = flat.reshape(*x.shape[:-1], w.shape[0])
        else:
            y = jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=out)
        if scale is not None:
            y = (y * scale).astype(x.dtype)
        return y if self.bias is None else y + self.bias[...]

    def _split_knobs(self, rows: int, dtype) -> dict | None:
        """The streamer's knobs where `split_product` of `rows` rows of `dtype` gives its partials (a
        streamed product with no folded norm, bias or int8 rows), else None."""
        w = self.weight[...]
        if (
            self.eps is not None
            or self.bias is not None
            or self.weight_scale is not None
            or reduces(rows, self.small_rows, w)
        ):
            return None
        return self._streamed(rows, jax.ShapeDtypeStruct((rows, w.shape[1]), dtype), w)

    def streams(self, rows: int, dtype) -> bool:
        """Whether `split_product` of `rows` rows of `dtype` gives the weight streamer's partials."""
        return self._split_knobs(rows, dtype) is not None

    def split_product(self, x: jax.Array) -> tuple[jax.Array, bool]:
        """This product of x [..., K] for a consumer that sums a split product itself
        (`residual_norm(..., partials=True)`): (the streamer's output [S, 64, N] as it is, True) where
        `streams`, else (the product, False). The sum of the partials, which XLA would run as a kernel
        of its own before a Pallas consumer, then happens in that consumer."""
        rows = math.prod(x.shape[:-1])
        knobs = self._split_knobs(rows, x.dtype)
        if knobs is None:
            return self(x), False
        flat = x.reshape(rows, x.shape[-1])
        return row_matmul_mgpu.row_matmul(flat, self.weight[...], partials=True, **knobs), True

    def to_int8(self) -> None:
        """Stores this product's weight as int8 rows and a float32 scale a row (`int8_rows`), in place."""
        if self.weight_scale is None:
            rows, scale = quantized_rows(self.weight[...])
            self.weight, self.weight_scale = nnx.Param(rows), nnx.Param(scale)

    @staticmethod
    def _streamed(rows: int, x: jax.Array, w: jax.Array) -> dict | None:
        """The streamer's knobs where a verify's product reads its weight on Hopper's units
        (`streamed_products`), else None."""
        if not attention.on_hopper() or not row_matmul_mgpu.supports(
            jax.ShapeDtypeStruct((rows, x.shape[-1]), x.dtype), w
        ):
            return None
        return streamer_knobs(rows, *w.shape, w.size * w.dtype.itemsize, num_sms=flash_block.NUM_SMS)

    def folded_norm(self) -> dict:
        """`fused_linear`'s prologue arguments for this product's folded norm: its statistics, with a
        weight of ones (the norm's own weight is in the matrix)."""
        if self.eps is None:
            raise ValueError("this product has no norm folded into it")
        return dict(norm_weight=jnp.ones((self.weight.shape[1],), self.weight.dtype), eps=self.eps)

    def parts(self, x: jax.Array, normed: jax.Array | None = None) -> list[jax.Array]:
        return jnp.split(self(x, normed), self.split_at, axis=-1)


class RMSNorm(nnx.Module):
    """Statistics in float32; the weight multiplies the result cast back to the input dtype (as HF)."""

    def __init__(self, dim: int, eps: float, *, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        return self.weight[...] * (x32 * inverse_rms(x32, self.eps)).astype(x.dtype)


def inverse_rms(x32: jax.Array, eps: float) -> jax.Array:
    """RMSNorm's statistics of float32 rows x32 [..., H]: rsqrt(mean(x^2) + eps), [..., 1]."""
    return jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


class SelfAttentionProjections(nnx.Module):
    """q/k/v/o projections of one layer (the attention itself is `attention.py`'s)."""

    def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs):
        h, d = config.hidden_size, config.head_dim
        self.q_proj = Linear(h, config.num_heads * d, bias=config.qkv_bias, dtype=dtype, rngs=rngs)
        self.k_proj = Linear(h, config.num_kv_heads * d, bias=config.qkv_bias, dtype=dtype, rngs=rngs)
        self.v_proj = Linear(h, config.num_kv_heads * d, bias=config.qkv_bias, dtype=dtype, rngs=rngs)
        self.o_proj = Linear(config.num_heads * d, h, bias=config.o_bias, dtype=dtype, rngs=rngs)
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d

    def kv(self, x, rope: Rope):
        """k (after RoPE), v: [B, T, Hkv, D]."""
        b, t, _ = x.shape
        k = self.k_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        return rotate(k, *rope), v

    def qkv(self, x, rope: Rope):
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, self.num_heads, self.head_dim)
        k, v = self.kv(x, rope)
        return rotate(q, *rope), k, v

    def qkv_product(self, x):
        """q|k|v before RoPE, [B, T, (Hq + 2 Hkv) * D]: what `PackedAttentionProjections` computes in one."""
        return jnp.concatenate([self.q_proj(x), self.k_proj(x), self.v_proj(x)], axis=-1)


class PackedAttentionProjections(nnx.Module):
    """`SelfAttentionProjections` with q/k/v as one `PackedLinear` (inference layout)."""

    def __init__(self, attn: SelfAttentionProjections, small_rows: Sequence[int] = (), norm: RMSNorm | None = None):
        self.qkv_proj = PackedLinear([attn.q_proj, attn.k_proj, attn.v_proj], small_rows, norm)
        self.o_proj = PackedLinear([attn.o_proj], small_rows)
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim

    def qkv(self, x, rope: Rope):
        b, t, _ = x.shape
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        # q and k are adjacent in the packed product: rotated together, they take one elementwise
        # op per layer instead of two (the rotation is per head, so the result is the same).
        qk, v = jnp.split(self.qkv_proj(x), [(hq + hkv) * d], axis=-1)
        qk = rotate(qk.reshape(b, t, hq + hkv, d), *rope)
        return qk[:, :, :hq], qk[:, :, hq:], v.reshape(b, t, hkv, d)

    def kv(self, x, rope: Rope):
        _, k, v = self.qkv(x, rope)
        return k, v

    def qkv_product(self, x, normed=None):
        """q|k|v before RoPE, [B, T, (Hq + 2 Hkv) * D] (normed: as `PackedLinear`'s)."""
        return self.qkv_proj(x, normed)


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs):
        h, f, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = Linear(h, f, bias=bias, dtype=dtype, rngs=rngs)
        self.up_proj = Linear(h, f, bias=bias, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(f, h, bias=bias, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class PackedMLP(nnx.Module):
    """`MLP` with gate and up as one `PackedLinear` (inference layout)."""

    def __init__(self, mlp: MLP, small_rows: Sequence[int] = (), norm: RMSNorm | None = None):
        self.gate_up_proj = PackedLinear([mlp.gate_proj, mlp.up_proj], small_rows, norm)
        self.down_proj = PackedLinear([mlp.down_proj], small_rows)

    def _gated(self, x, normed=None):
        """silu(gate) * up, the down product's input."""
        gate, up = self.gate_up_proj.parts(x, normed)
        return jax.nn.silu(gate) * up

    def __call__(self, x, normed=None):
        return self.down_proj(self._gated(x, normed))

    def split_product(self, x, normed=None) -> tuple[jax.Array, bool]:
        """This MLP's output as the down product's `PackedLinear.split_product`."""
        return self.down_proj.split_product(self._gated(x, normed))


class DecoderLayer(nnx.Module):
    """Pre-norm block, split at the attention so callers choose how q/k/v meet the cache."""

    def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.self_attn = SelfAttentionProjections(config, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.mlp = MLP(config, dtype=dtype, rngs=rngs)

    def qkv(self, x, rope: Rope):
        """q [B,T,Hq,D], k [B,T,Hkv,D] (both after RoPE), v [B,T,Hkv,D]."""
        return self.self_attn.qkv(_normed(self.input_layernorm, x), rope)

    def qkv_product(self, x, normed=None):
        """q|k|v before RoPE, [B, T, (Hq + 2 Hkv) * D], for an attention that rotates them itself.
        normed: x under the input norm (without its weight), made by the previous layer's
        `finish_with_norm` (packed layout only)."""
        if normed is not None:
            return self.self_attn.qkv_product(x, normed)
        return self.self_attn.qkv_product(_normed(self.input_layernorm, x))

    def finish(self, x, attn_out):
        """The residual stream after this layer, given the attention output o [B,T,Hq,D]."""
        b, t = x.shape[:2]
        x = x + self.self_attn.o_proj(attn_out.reshape(b, t, -1))
        return x + self.mlp(_normed(self.post_attention_layernorm, x))

    def finish_with_norm(self, x, attn_out, eps: float, weight=None):
        """`finish` with each residual add and the norm after it as one `residual_norm` kernel
        (packed layout, where `norms_first`): the residual stream after this layer and that stream
        under an RMSNorm of eps, without a weight (the next layer's input norm, whose weight is in
        its q|k|v matrix) or with `weight` (the final norm's)."""
        b, t = x.shape[:2]
        delta, partials = self.self_attn.o_proj.split_product(attn_out.reshape(b, t, -1))
        x, normed = residual_norm(x, delta, self.mlp.gate_up_proj.eps, partials=partials)
        delta, partials = self.mlp.split_product(x, normed)
        return residual_norm(x, delta, eps, weight=weight, partials=partials)

    def streams_residuals(self, rows: int, dtype) -> bool:
        """Whether both products before a residual add (o and down) stream their weight at `rows`
        rows (`PackedLinear.streams`; packed layout) and the norms after them scale the next
        products' input (`norms_first`, as at a 7B's width): `finish_with_norm` then sums their
        partials in its norm kernels."""
        return (
            self.packed
            and norms_first(rows, self.mlp.gate_up_proj.weight.shape[1])
            and self.self_attn.o_proj.streams(rows, dtype)
            and self.mlp.down_proj.streams(rows, dtype)
        )

    @property
    def packed(self) -> bool:
        return isinstance(self.self_attn, PackedAttentionProjections)

    def fused_qkv_product(self, x):
        """`qkv_product` as one Pallas kernel, the norm in its prologue (packed layout only)."""
        b, t, h = x.shape
        proj = self.self_attn.qkv_proj
        y = fused_linear(x.reshape(b * t, h), proj.weight[...], **proj.folded_norm(), bias=_value(proj.bias))
        return y.reshape(b, t, -1)

    def fused_finish(self, x, attn_out):
        """`finish` as three Pallas kernels (packed layout only): the o projection with the residual
        add in its epilogue; the gate|up projection with the post-attention norm in its prologue; the
        down projection with SwiGLU in its prologue and the residual add in its epilogue. XLA runs
        these as GEMMs plus separate norm-statistics, SwiGLU and add kernels."""
        b, t, h = x.shape
        rows = x.reshape(b * t, h)
        o_proj, gate_up, down = self.self_attn.o_proj, self.mlp.gate_up_proj, self.mlp.down_proj
        rows = fused_linear(attn_out.reshape(b * t, -1), o_proj.weight[...], residual=rows, bias=_value(o_proj.bias))
        hidden = fused_linear(rows, gate_up.weight[...], **gate_up.folded_norm(), bias=_value(gate_up.bias))
        rows = fused_linear(hidden, down.weight[...], swiglu=True, residual=rows, bias=_value(down.bias))
        return rows.reshape(b, t, h)


class Transformer(nnx.Module):
    """Llama / Qwen2 decoder. Parameters in `dtype` (bfloat16 on GPU, float32 for tests)."""

    def __init__(self, config: ModelConfig, *, dtype="bfloat16", rngs: nnx.Rngs):
        dtype = jnp.dtype(dtype)
        self.config = config
        self.dtype = dtype
        self.embed = nnx.Param(_normal(rngs, (config.vocab_size, config.hidden_size), dtype))
        self.layers = nnx.List([DecoderLayer(config, dtype=dtype, rngs=rngs) for _ in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nnx.Param(_normal(rngs, (config.vocab_size, config.hidden_size), dtype))
        )
        # False sends one-token blocks through the general block path (benchmarks compare the two).
        self.one_token_attention = True
        # Each layer's projections as fused Pallas kernels (packed layout, impl "pallas": a verified
        # block and the one-token step). Off until timed on the GPU against XLA's
        # (benchmarks/decode_kernels.py compares the two).
        self.fused_projections = False
        # In the one-token step of one sequence, each residual add and the norm after it as one
        # kernel (`DecoderLayer.finish_with_norm`; packed layout, impl "pallas") instead of XLA's
        # add, sum of squares and scaling. More rows get fewer kernels from XLA itself: a verified
        # block's norm fusion also sums the product's split-K partials, and compiled for the H200,
        # SmolLM2's AR step at batch 2 / 4 / 8 is 197 / 298 / 343 kernels with XLA's norms against
        # 254 / 315 / 375 with these (BENCHMARKS.md, "The one-token step's residual adds"). A
        # verified block whose o and down products stream their weight (7B layers on Hopper) takes
        # them too: the kernel sums the streamer's partials, which XLA summed in an add kernel of
        # its own before the norm after the down product (BENCHMARKS.md, "A verify's streamed products").
        self.norm_kernels = True

    def _rope(self, positions: jax.Array) -> Rope:
        return rope_tables(positions, jnp.asarray(inverse_frequencies(self.config)))

    def inference_layout(self, small_rows: Sequence[int] = ()) -> Transformer:
        """This model with each layer's q/k/v and gate/up projections packed into one matrix each
        and every layer matrix stored [out, in] (`PackedLinear`, its products of `small_rows` rows
        as multiply-reduce), the two norms of a layer folded into the packed products after them
        (their layer attributes then None): the same function up to float rounding order, four
        matmuls per layer instead of seven. Other parameters share their arrays with this model (no
        copy), which is left as it is (`pack_in_place` packs this one). For inference only:
        checkpoint writers and training use the unpacked layout. Packing a packed model returns it
        as is."""
        model = nnx.clone(self)
        model.pack_in_place(small_rows)
        return model

    def pack_in_place(self, small_rows: Sequence[int] = ()) -> None:
        """Puts this model in `inference_layout`'s layout itself, a layer at a time: a layer's
        loaded matrices are let go as soon as its packed ones exist, so a model held nowhere else
        never needs much more than its own size plus one layer on the device."""
        for layer in self.layers:
            if isinstance(layer.self_attn, SelfAttentionProjections):
                layer.self_attn = PackedAttentionProjections(layer.self_attn, small_rows, layer.input_layernorm)
                layer.mlp = PackedMLP(layer.mlp, small_rows, layer.post_attention_layernorm)
                layer.input_layernorm = layer.post_attention_layernorm = None

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """int32[B,T] -> [B,T,H] in the parameter dtype."""
        return jnp.take(self.embed[...], tokens, axis=0)

    def lm_logits(self, hidden: jax.Array) -> jax.Array:
        """[B,T,H] -> float32[B,T,V]. No final norm here: the draft feeds un-normalised features."""
        head = self.embed[...] if self.lm_head is None else self.lm_head[...]
        return jnp.einsum("bth,vh->btv", hidden, head, preferred_element_type=jnp.float32)

    def _causal_layers(self, x, positions, lengths, layers, impl, on_kv=None):
        """Run `layers` over x [B,L,H] with causal self-attention; on_kv(i, k, v) sees each
        layer's keys and values as they are made."""
        rope = self._rope(positions)
        for i, layer in enumerate(layers):
            q, k, v = layer.qkv(x, rope)
            x = layer.finish(x, attention.prefill_attention(q, k, v, lengths, impl=impl))
            if on_kv is not None:
                on_kv(i, k, v)
        return x

    def forward_logits(self, tokens: jax.Array, *, attn_impl: str | None = None) -> jax.Array:
        """Full causal forward at positions 0..L-1, no cache: int32[B,L] -> float32[B,L,V]."""
        b, l = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, l))
        lengths = jnp.full((b,), l, jnp.int32)
        x = self._causal_layers(self.embed_tokens(tokens), positions, lengths, self.layers, _impl(attn_impl))
        return self.lm_logits(self.norm(x))

    def prefill(self, tokens: jax.Array, lengths: jax.Array, cache: KVCache, *, attn_impl: str | None = None):
        """Right-padded prompts tokens int32[B,L] (L <= cache.max_len) with true lengths int32[B]
        into an empty cache. Returns (float32[B,V] logits at each prompt's last token, cache with
        lengths == lengths). Rows [lengths[b], L) hold padding K/V that later writes overwrite."""
        b, l = tokens.shape
        if l > cache.max_len:
            raise UserError(
                f"a prompt of {l} tokens does not fit a KV cache of {cache.max_len} rows: "
                "shorten the prompt or allocate a longer cache"
            )
        positions = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, l))
        lengths = lengths.astype(jnp.int32)
        new_k, new_v = list(cache.k), list(cache.v)

        def store(i, k, v):  # in program order right after each layer: its block K/V can die early
            new_k[i] = jax.lax.dynamic_update_slice(new_k[i], k.astype(new_k[i].dtype), (0, 0, 0, 0))
            new_v[i] = jax.lax.dynamic_update_slice(new_v[i], v.astype(new_v[i].dtype), (0, 0, 0, 0))

        x = self._causal_layers(self.embed_tokens(tokens), positions, lengths, self.layers, _impl(attn_impl), store)
        last = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)  # [B,1,H]
        logits = self.lm_logits(self.norm(last))[:, 0]
        return logits, cache.replace(k=tuple(new_k), v=tuple(new_v), lengths=lengths)

    def forward_block(self, tokens, positions, block_mask, cache: KVCache, *, attn_impl: str | None = None):
        """T new tokens int32[B,T] at positions int32[B,T] against the cache rows [0, lengths[b])
        plus each other under block_mask bool[B,T,T]. Returns (float32[B,T,V] logits, cache,
        BlockKV of the T tokens); lengths unchanged.

        T > 1 (tree verification): the attention takes the block's own K/V directly and `commit`
        keeps the accepted rows. With impl "pallas" the block is written at rows [lengths[b],
        lengths[b] + T) of every layer by the attention kernel itself (the caller keeps
        lengths + T <= S_max; rows past lengths hold anything, so nothing reads them) and the
        BlockKV says so; otherwise the cache is left as it is and the BlockKV holds the block's K/V.
        T = 1 (AR decoding, lengths < S_max) writes its row at lengths[b] of every layer
        (committing it is lengths += 1) and, with one_token_attention, attends and writes in one
        call (`attention.attend_and_write_block`: with impl "pallas" one kernel that also
        stores the row)."""
        impl = _impl(attn_impl)
        rope = self._rope(positions)
        x = self.embed_tokens(tokens)
        one_row = tokens.shape[1] == 1
        one_token = one_row and self.one_token_attention
        block_in_cache = not one_row and impl == "pallas"
        cache_k, cache_v, block_k, block_v = [], [], [], []
        fused = self.fused_projections and impl == "pallas" and (block_in_cache or one_token)
        rows = tokens.shape[0] * tokens.shape[1]
        norm_kernels = (
            self.norm_kernels
            and impl == "pallas"
            and not fused
            and all(layer.packed for layer in self.layers)
            and (
                (one_token and rows == 1)
                or (block_in_cache and all(layer.streams_residuals(rows, self.dtype) for layer in self.layers))
            )
        )
        normed = None  # x under the next norm (the final one with its weight) where a residual_norm kernel made it
        for i, (layer, k_cache, v_cache) in enumerate(zip(self.layers, cache.k, cache.v)):
            fused_layer = fused and layer.packed
            if one_token or block_in_cache:
                o, k_cache, v_cache = attention.attend_and_write_block(
                    layer.fused_qkv_product(x) if fused_layer else layer.qkv_product(x, normed),
                    rope,
                    k_cache,
                    v_cache,
                    cache.lengths,
                    block_mask,
                    num_heads=self.config.num_heads,
                    impl=impl,
                )
                if one_token:  # the row as written (AR decoding never reads it: XLA drops this then)
                    block_k.append(_cache_row(k_cache, cache.lengths))
                    block_v.append(_cache_row(v_cache, cache.lengths))
            else:
                q, k, v = layer.qkv(x, rope)
                if one_row:
                    # Write first: the updated buffer is the one that lives on, so XLA can update it
                    # in place (the attention reads only rows < lengths).
                    k_cache = attention.write_cache_rows(k_cache, k, cache.lengths)
                    v_cache = attention.write_cache_rows(v_cache, v, cache.lengths)
                o = attention.hybrid_tree_attention(q, k_cache, v_cache, cache.lengths, k, v, block_mask, impl=impl)
                block_k.append(k)
                block_v.append(v)
            if norm_kernels:
                last = i == len(self.layers) - 1
                x, normed = layer.finish_with_norm(x, o, self.norm.eps, self.norm.weight[...] if last else None)
            else:
                x = layer.fused_finish(x, o) if fused_layer else layer.finish(x, o)
            cache_k.append(k_cache)
            cache_v.append(v_cache)
        cache = cache.replace(k=tuple(cache_k), v=tuple(cache_v))
        block = BlockKV(k=None, v=None) if block_in_cache else BlockKV(k=tuple(block_k), v=tuple(block_v))
        final = self.norm(x) if normed is None else normed  # the last layer's kernel applied its weight
        return self.lm_logits(final), cache, block

    def last_layer_kv(
        self, tokens: jax.Array, positions: jax.Array, *, attn_impl: str | None = None, with_features: bool = False
    ):
        """The draft's training input: the last layer's k (after RoPE) and v, each [B,L,Hkv,D].
        Runs layers 0..N-2 causally (by index; positions only rotate) and then only the last
        layer's input norm and k/v projections. with_features: the last layer whole as well, and
        also return the final-normed features [B,L,H] its LM head reads (the target's own
        next-token distribution, for distillation): (k, v, features)."""
        b, l = tokens.shape
        lengths = jnp.full((b,), l, jnp.int32)
        x = self._causal_layers(self.embed_tokens(tokens), positions, lengths, self.layers[:-1], _impl(attn_impl))
        last = self.layers[-1]
        if not with_features:
            return last.self_attn.kv(_normed(last.input_layernorm, x), self._rope(positions))
        q, k, v = last.qkv(x, self._rope(positions))
        out = last.finish(x, attention.prefill_attention(q, k, v, lengths, impl=_impl(attn_impl)))
        return k, v, self.norm(out)


def _normed(norm: RMSNorm | None, x: jax.Array) -> jax.Array:
    """x under `norm`, or x itself where the norm is folded into the next product (None)."""
    return x if norm is None else norm(x)


def _value(param) -> jax.Array | None:
    return None if param is None else param[...]


def _cache_row(cache_rows: jax.Array, row: jax.Array) -> jax.Array:
    """Row row[b] of cache_rows [B,S,H,D] -> [B,1,H,D]."""
    return jax.vmap(lambda c, r: jax.lax.dynamic_slice_in_dim(c, r, 1, axis=0))(cache_rows, row)


def _impl(attn_impl: str | None) -> str:
    return attention.default_impl() if attn_impl is None else attn_impl
