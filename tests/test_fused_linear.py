"""fused_linear (interpret mode) == a float64 reference of prologue(x) @ weight.T + bias + residual.

The reference rounds where the kernel must: the RMSNorm output to x's dtype before the norm weight
multiplies it, that product, and silu(gate) * up, each to x's dtype. In bfloat16 the checks are
tight enough (the output's own rounding plus a little) that normalising in another order fails
them. Shapes put N off the column tile, M off the row block (130 rows: two blocks) and K at one
and three chunks of 64 (64, 192) and at 96, which takes chunks of 32.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longspec_jax.model import RMSNorm
from pallas_kernels.fused_linear import fused_linear

EPS = 1e-6
# bf16 keeps 8 significant bits: rounding the output moves it by at most 2^-8 of itself.
BF16_RTOL = 2.0**-8


def as_f64(x):
    return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


def rounded(x, dtype):
    """x (float64) rounded to dtype, back as float64."""
    return as_f64(jnp.asarray(x, jnp.float32).astype(dtype))


def reference(x, weight, *, norm_weight=None, swiglu=False, bias=None, residual=None):
    """float64 [M, N] from the inputs as given, rounding the prologue's output as the kernel does."""
    dtype = x.dtype
    h = as_f64(x)
    if norm_weight is not None:
        h = rounded(h / np.sqrt(np.mean(h * h, axis=1, keepdims=True) + EPS), dtype)
        h = rounded(as_f64(norm_weight) * h, dtype)
    elif swiglu:
        gate, up = np.split(h, 2, axis=1)
        h = rounded(gate / (1.0 + np.exp(-gate)) * up, dtype)
    y = h @ as_f64(weight).T
    if bias is not None:
        y += as_f64(bias)
    if residual is not None:
        y += as_f64(residual)
    return y


def random_inputs(seed, m, n, k, prologue, extras, dtype):
    """The arrays fused_linear takes (by keyword), of about unit-sized outputs, already in dtype."""
    rng = np.random.default_rng(seed)
    k_in = 2 * k if prologue == "swiglu" else k
    args = {
        "x": jnp.asarray(rng.standard_normal((m, k_in)), dtype),
        "weight": jnp.asarray(rng.standard_normal((n, k)) / np.sqrt(k), dtype),
    }
    if prologue == "norm":
        args["norm_weight"] = jnp.asarray(1.0 + 0.5 * rng.standard_normal(k), dtype)
    if "bias" in extras:
        args["bias"] = jnp.asarray(rng.standard_normal(n), dtype)
    if "residual" in extras:
        args["residual"] = jnp.asarray(rng.standard_normal((m, n)), dtype)
    return args


def call(args, prologue, eps=EPS, interpret=True, **blocks):
    return fused_linear(**args, swiglu=prologue == "swiglu", eps=eps, interpret=interpret, **blocks)


# (M, N, K, prologue, extras, block sizes): each prologue with and without bias and residual, each
# M and K; the last case forces 16-row blocks over 37 rows and K chunks of 16.
CASES = [
    (1, 100, 64, "none", "bias", {}),
    (16, 100, 192, "none", "residual", {}),
    (130, 100, 96, "none", "", {}),
    (5, 100, 192, "norm", "", {}),
    (16, 100, 96, "norm", "bias", {}),
    (37, 100, 64, "norm", "bias residual", {}),
    (130, 100, 192, "norm", "residual", {}),
    (1, 100, 96, "swiglu", "residual", {}),
    (37, 100, 192, "swiglu", "bias", {}),
    (130, 100, 64, "swiglu", "bias residual", {}),
    (37, 100, 96, "norm", "bias residual", {"block_rows": 16, "block_cols": 32, "block_k": 16}),
]


@pytest.mark.parametrize("m,n,k,prologue,extras,blocks", CASES)
def test_float32_matches_float64_reference(m, n, k, prologue, extras, blocks):
    args = random_inputs([m, n, k, len(prologue), len(extras)], m, n, k, prologue, extras, jnp.float32)

    y = call(args, prologue, **blocks)

    assert y.shape == (m, n) and y.dtype == jnp.float32
    want = reference(**args, swiglu=prologue == "swiglu")
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5)


# Every other case (each prologue, each M) and the forced blocks.
@pytest.mark.parametrize("m,n,k,prologue,extras,blocks", CASES[1::2] + CASES[-1:])
def test_bfloat16_matches_float64_reference_of_the_rounded_intermediates(m, n, k, prologue, extras, blocks):
    """Off only by the output's rounding to bf16 and float32 sums (atol)."""
    args = random_inputs([m, n, k, len(prologue), len(extras), 1], m, n, k, prologue, extras, jnp.bfloat16)

    y = call(args, prologue, **blocks)

    assert y.dtype == jnp.bfloat16
    want = reference(**args, swiglu=prologue == "swiglu")
    np.testing.assert_allclose(as_f64(y), want, rtol=BF16_RTOL, atol=1e-3)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_norm_prologue_matches_the_model_rmsnorm(dtype):
    """The unfused layer: longspec_jax.model.RMSNorm, then the product in float32. An eps large
    enough to move the result shows that it reaches the statistics."""
    m, n, k, eps = 21, 100, 192, 0.1
    args = random_inputs(3, m, n, k, "norm", "", dtype)
    norm = RMSNorm(k, eps, dtype=dtype)
    norm.weight[...] = args["norm_weight"]

    y = call(args, "norm", eps=eps)

    product = jnp.dot(norm(args["x"]), args["weight"].T, precision="highest", preferred_element_type=jnp.float32)
    if dtype == jnp.float32:
        np.testing.assert_allclose(np.asarray(y), np.asarray(product), rtol=1e-5, atol=1e-5)
    else:
        np.testing.assert_allclose(as_f64(y), as_f64(product), rtol=BF16_RTOL, atol=1e-3)


# (M, N, K, prologue, extras, block sizes) over an int8 weight with a scale a row: each prologue,
# rows within one and over two row blocks, N off the column tile.
INT8_CASES = [
    (1, 100, 192, "none", "bias", {}),
    (16, 100, 96, "norm", "residual", {}),
    (37, 100, 64, "swiglu", "bias residual", {}),
    (130, 100, 192, "none", "", {"block_rows": 64, "block_cols": 32, "block_k": 64}),
]


def int8_weight(args, seed):
    """args with its weight as int8 rows of very different scales (float32 scale a row)."""
    rng = np.random.default_rng(seed)
    n, k = args["weight"].shape
    args = dict(args, weight=jnp.asarray(rng.integers(-127, 128, (n, k)), jnp.int8))
    return dict(args, weight_scale=jnp.asarray(rng.uniform(0.1, 3.0, n) / (127 * np.sqrt(k)), jnp.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("m,n,k,prologue,extras,blocks", INT8_CASES)
def test_int8_weight_matches_float64_reference_of_the_scaled_rows(m, n, k, prologue, extras, blocks, dtype):
    args = int8_weight(random_inputs([m, n, k, 8], m, n, k, prologue, extras, dtype), m)

    y = call(args, prologue, **blocks)

    assert y.shape == (m, n) and y.dtype == dtype
    scaled = as_f64(args["weight"]) * as_f64(args["weight_scale"])[:, None]
    plain = {key: v for key, v in args.items() if key not in ("weight", "weight_scale")}
    want = reference(**plain, weight=scaled, swiglu=prologue == "swiglu")
    if dtype == jnp.float32:
        np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5)
    else:
        np.testing.assert_allclose(as_f64(y), want, rtol=BF16_RTOL, atol=1e-3)


def bad_inputs():
    x, w = jnp.zeros((2, 64), jnp.bfloat16), jnp.zeros((100, 64), jnp.bfloat16)
    g = jnp.ones((64,), jnp.bfloat16)
    yield "1-d x", (x[0], w), {}, r"x \[M, K_in\]"
    yield "no rows", (x[:0], w), {}, "at least one row"
    yield "dtypes differ", (x, w.astype(jnp.float32)), {}, "float dtype"
    yield "integer inputs", (x.astype(jnp.int32), w.astype(jnp.int32)), {}, "float dtype"
    yield "K differs", (x, w[:, :32]), {}, "K = 32 columns"
    yield "swiglu without gate | up", (x, w), {"swiglu": True}, r"2 K \(gate \| up\)"
    yield "norm and swiglu", (jnp.zeros((2, 128), jnp.bfloat16), w), {"norm_weight": g, "swiglu": True}, "exclude"
    yield "norm_weight shape", (x, w), {"norm_weight": g[:32]}, "norm_weight must be"
    yield "norm_weight dtype", (x, w), {"norm_weight": g.astype(jnp.float32)}, "norm_weight must be"
    yield "K = 40", (x[:, :40], w[:, :40]), {}, "no power-of-two divisor >= 16"
    yield "residual shape", (x, w), {"residual": jnp.zeros((2, 64), jnp.bfloat16)}, r"residual .*\(2, 100\)"
    yield "bias shape", (x, w), {"bias": jnp.zeros((2, 100), jnp.bfloat16)}, r"bias .*\(100,\)"
    yield "block_k not dividing K", (x[:, :48], w[:, :48]), {"block_k": 32}, "must divide K"
    yield "block_rows", (x, w), {"block_rows": 8}, "block_rows must be a power of two"
    yield "block_cols", (x, w), {"block_cols": 48}, "block_cols must be a power of two"
    scale = jnp.ones((100,), jnp.float32)
    yield "weight_scale beside a float weight", (x, w), {"weight_scale": scale}, "beside an int8 weight"
    yield "weight_scale shape", (x, w.astype(jnp.int8)), {"weight_scale": scale[:50]}, r"float32 \[N\] = \(100,\)"
    yield "int8 weight without a scale", (x, w.astype(jnp.int8)), {}, "float dtype"


@pytest.mark.parametrize("name,args,kwargs,match", list(bad_inputs()), ids=[c[0] for c in bad_inputs()])
def test_bad_inputs_raise_value_error(name, args, kwargs, match):
    with pytest.raises(ValueError, match=f"fused_linear: .*{match}"):
        fused_linear(*args, interpret=True, **kwargs)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the compiled Pallas kernel needs an NVIDIA GPU")
@pytest.mark.parametrize("m", [1, 69])
@pytest.mark.parametrize("n,k,prologue,extras", [(960, 576, "norm", ""), (576, 1536, "swiglu", "residual")])
def test_gpu_compiled_kernel_matches_reference(m, n, k, prologue, extras):
    """The compiled kernel at SmolLM2's shapes (bf16)."""
    args = random_inputs(m, m, n, k, prologue, extras, jnp.bfloat16)

    y = jax.jit(lambda a: call(a, prologue, interpret=False))(args)

    want = reference(**args, swiglu=prologue == "swiglu")
    np.testing.assert_allclose(as_f64(y), want, rtol=BF16_RTOL, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the compiled Pallas kernel needs an NVIDIA GPU")
@pytest.mark.parametrize("m", [1, 16, 64])
def test_gpu_compiled_int8_kernel_matches_reference(m):
    """The compiled kernel over an int8 weight at a 7B draft's o product (bf16 rows)."""
    args = int8_weight(random_inputs(m, m, 4096, 4096, "none", "residual", jnp.bfloat16), m)

    y = jax.jit(lambda a: call(a, "none", interpret=False))(args)

    scaled = as_f64(args["weight"]) * as_f64(args["weight_scale"])[:, None]
    want = reference(args["x"], scaled, residual=args["residual"])
    np.testing.assert_allclose(as_f64(y), want, rtol=BF16_RTOL, atol=2e-3)
