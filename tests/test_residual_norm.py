"""The residual-add-and-norm kernel (interpret mode) against a float64 reference and the model's XLA ops.

The reference follows the model's rounding order in float64: h = x + delta rounded to the input
dtype, its RMS statistics from that rounded h, n rounded once. Float32 rows must agree to float32
rounding; bfloat16 rows may differ by one bfloat16 step where the float32 statistics round
differently from float64's.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longspec_jax.model import RMSNorm
from pallas_kernels.residual_norm import MAX_WIDTH, residual_norm

EPS = 1e-5


def reference(x, delta, eps):
    """(h, n) in float64, h rounded to x's dtype as the model rounds it."""
    h = (np.asarray(x, np.float64) + np.asarray(delta, np.float64)).astype(np.float32)
    h = np.asarray(jnp.asarray(h).astype(x.dtype), np.float64)
    n = h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + eps)
    return h, n


# Widths: SmolLM2's 576 (not a power of two: masked lanes), a 7B's 4096, Qwen2.5-7B's 3584; rows as an
# AR step at batch 1 and 4 and a verify's block.
@pytest.mark.parametrize("shape", [(1, 1, 576), (4, 1, 4096), (1, 9, 3584), (2, 3, 64)])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-6), (jnp.bfloat16, 1e-2)])
def test_matches_float64_reference(shape, dtype, tol):
    rng = np.random.default_rng(shape[-1])
    x = jnp.asarray(rng.normal(size=shape) * 3, dtype)
    delta = jnp.asarray(rng.normal(size=shape), dtype)
    h, n = residual_norm(x, delta, EPS, interpret=True)
    want_h, want_n = reference(x, delta, EPS)
    assert h.dtype == n.dtype == dtype and h.shape == n.shape == shape
    np.testing.assert_array_equal(np.asarray(h, np.float64), want_h)
    np.testing.assert_allclose(np.asarray(n, np.float64), want_n, rtol=tol, atol=tol)


def test_equals_the_models_add_then_norm():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(2, 5, 576)), jnp.float32)
    delta = jnp.asarray(rng.normal(size=(2, 5, 576)), jnp.float32)
    h, n = residual_norm(x, delta, EPS, interpret=True)
    norm = RMSNorm(576, EPS, dtype=jnp.float32)
    np.testing.assert_array_equal(h, x + delta)
    np.testing.assert_allclose(n, norm(x + delta), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-6), (jnp.bfloat16, 2e-2)])
def test_a_weight_scales_the_normed_rows(dtype, tol):
    """With the final norm's weight: n rounded, times the weight, rounded again (model.RMSNorm's
    order), against float64; and equal to the model's RMSNorm of h in float32."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(1, 1, 576)) * 3, dtype)
    delta = jnp.asarray(rng.normal(size=(1, 1, 576)), dtype)
    weight = jnp.asarray(rng.uniform(0.5, 2.0, size=576), dtype)
    h, n = residual_norm(x, delta, EPS, weight=weight, interpret=True)
    want_h, want_n = reference(x, delta, EPS)
    np.testing.assert_array_equal(np.asarray(h, np.float64), want_h)
    np.testing.assert_allclose(np.asarray(n, np.float64), want_n * np.asarray(weight, np.float64), rtol=tol, atol=tol)
    assert not np.allclose(np.asarray(n, np.float64), want_n, rtol=tol, atol=tol)  # the weight is applied
    if dtype == jnp.float32:
        norm = RMSNorm(576, EPS, dtype=dtype)
        norm.weight[...] = weight
        np.testing.assert_allclose(n, norm(h), rtol=1e-6, atol=1e-6)


def _rounded_sum(partials, rows, dtype):
    """A split product's partials [S, R, H] summed in float64 over their first `rows` rows, rounded
    to `dtype` as the product's output is."""
    total = np.asarray(partials, np.float64).sum(axis=0)[:rows]
    return np.asarray(jnp.asarray(total.astype(np.float32)).astype(dtype))


# The weight streamer's output: two float32 slices of K over 64 padded rows, or one slice already in
# the rows' dtype; x's rows (5, a verify's 20) fewer than the partials' (the rest must not be read).
@pytest.mark.parametrize("splits,partial_dtype", [(1, jnp.bfloat16), (2, jnp.float32), (3, jnp.float32)])
@pytest.mark.parametrize("x_shape", [(1, 5, 576), (1, 20, 4096)])
def test_partials_are_summed_and_rounded_as_the_products_output(splits, partial_dtype, x_shape):
    rng = np.random.default_rng(splits + x_shape[1])
    x = jnp.asarray(rng.normal(size=x_shape) * 3, jnp.bfloat16)
    partials = jnp.asarray(rng.normal(size=(splits, 64, x_shape[-1])), partial_dtype)
    partials = partials.at[:, x_shape[1] :].set(1e4)  # rows past x's: read, they would show
    h, n = residual_norm(x, partials, EPS, partials=True, interpret=True)
    delta = _rounded_sum(partials, x_shape[1], jnp.bfloat16).reshape(x_shape)
    want_h, want_n = reference(x, jnp.asarray(delta), EPS)
    np.testing.assert_array_equal(np.asarray(h, np.float64), want_h)
    np.testing.assert_allclose(np.asarray(n, np.float64), want_n, rtol=1e-2, atol=1e-2)
    weight = jnp.asarray(rng.uniform(0.5, 2.0, size=x_shape[-1]), jnp.bfloat16)
    _, weighted = residual_norm(x, partials, EPS, partials=True, weight=weight, interpret=True)
    np.testing.assert_allclose(
        np.asarray(weighted, np.float64), want_n * np.asarray(weight, np.float64), rtol=2e-2, atol=2e-2
    )


def test_zero_row_gives_zeros_not_nan():
    x = jnp.zeros((1, 576), jnp.bfloat16)
    h, n = residual_norm(x, x, EPS, interpret=True)
    assert not np.any(np.isnan(np.asarray(n, np.float32))) and not np.any(np.asarray(n, np.float32))


def test_bad_shapes_name_the_fix():
    with pytest.raises(ValueError, match="one shape"):
        residual_norm(jnp.zeros((1, 8)), jnp.zeros((1, 16)), EPS)
    with pytest.raises(ValueError, match=f"up to {MAX_WIDTH}"):
        residual_norm(jnp.zeros((1, 2 * MAX_WIDTH)), jnp.zeros((1, 2 * MAX_WIDTH)), EPS)
    with pytest.raises(ValueError, match=r"weight must be \[H\] = \(8,\)"):
        residual_norm(jnp.zeros((1, 8)), jnp.zeros((1, 8)), EPS, weight=jnp.ones((16,)))
    with pytest.raises(ValueError, match=r"partials must be \[S, R >= 5, H = 8\]"):
        residual_norm(jnp.zeros((1, 5, 8)), jnp.zeros((2, 4, 8)), EPS, partials=True)  # too few rows
    with pytest.raises(ValueError, match=r"partials must be \[S, R >= 5, H = 8\]"):
        residual_norm(jnp.zeros((1, 5, 8)), jnp.zeros((2, 64, 16)), EPS, partials=True)  # another width


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the compiled Pallas kernel needs an NVIDIA GPU")
@pytest.mark.parametrize("shape", [(1, 1, 576), (4, 1, 4096), (74, 3584)])
def test_gpu_compiled_kernel_matches_reference(shape):
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=shape) * 3, jnp.bfloat16)
    delta = jnp.asarray(rng.normal(size=shape), jnp.bfloat16)
    weight = jnp.asarray(rng.uniform(0.5, 2.0, size=shape[-1]), jnp.bfloat16)
    h, n = jax.jit(lambda x, d: residual_norm(x, d, EPS, interpret=False))(x, delta)
    _, weighted = jax.jit(lambda x, d, w: residual_norm(x, d, EPS, weight=w, interpret=False))(x, delta, weight)
    want_h, want_n = reference(x, delta, EPS)
    np.testing.assert_array_equal(np.asarray(h, np.float64), want_h)
    np.testing.assert_allclose(np.asarray(n, np.float64), want_n, rtol=1e-2, atol=1e-2)
    want_weighted = want_n * np.asarray(weight, np.float64)
    np.testing.assert_allclose(np.asarray(weighted, np.float64), want_weighted, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the compiled Pallas kernel needs an NVIDIA GPU")
def test_gpu_compiled_kernel_sums_a_streamed_products_partials():
    """A 7B verify's 20 rows after its down product: the streamer's two float32 slices over 64 rows."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(1, 20, 4096)) * 3, jnp.bfloat16)
    partials = jnp.asarray(rng.normal(size=(2, 64, 4096)), jnp.float32).at[:, 20:].set(1e4)
    h, n = jax.jit(lambda x, p: residual_norm(x, p, EPS, partials=True, interpret=False))(x, partials)
    want_h, want_n = reference(x, jnp.asarray(_rounded_sum(partials, 20, jnp.bfloat16).reshape(x.shape)), EPS)
    np.testing.assert_array_equal(np.asarray(h, np.float64), want_h)
    np.testing.assert_allclose(np.asarray(n, np.float64), want_n, rtol=1e-2, atol=1e-2)
