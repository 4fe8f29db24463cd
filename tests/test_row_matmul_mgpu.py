"""The Mosaic GPU weight streamer against float64, in the GPU interpret mode on the CPU: row counts
from one to 64, strips of 64 to 256 columns, K in one slice and in several (float32 partials summed
after), rings of two to eight tiles, both output dtypes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import row_matmul_mgpu as rm


def _operands(rng, m, k, n):
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((n, k)), jnp.bfloat16)
    return x, w, np.asarray(x, np.float64) @ np.asarray(w, np.float64).T


@pytest.mark.parametrize(
    "m, k, n, knobs",
    [
        (64, 256, 256, dict(tile_n=128, stages=2)),  # two strips, one slice
        (1, 512, 192, dict(tile_n=64, splits=2, stages=3)),  # one row, padded; two slices of 256
        (16, 384, 256, dict(tile_n=256, splits=3, stages=8)),  # a ring longer than a slice's tiles
        (37, 128, 64, dict(tile_n=64, stages=4)),  # a ring longer than the whole K
    ],
)
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_matches_float64(m, k, n, knobs, out_dtype):
    x, w, ref = _operands(np.random.default_rng(m + k + n), m, k, n)
    with jax.default_device(jax.devices("cpu")[0]):  # the interpreter runs on the CPU, GPU or not
        y = rm.row_matmul(x, w, out_dtype=out_dtype, interpret=plgpu.InterpretGPUParams(), **knobs)
    assert y.shape == (m, n) and y.dtype == out_dtype
    # float32 accumulation of bfloat16 products: exact but for the order of the sums (and the
    # output's rounding to bfloat16)
    tol = 1e-4 if out_dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(y, np.float64), ref, rtol=tol, atol=tol * np.abs(ref).max())


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the compiled Mosaic GPU kernel needs a Hopper GPU")
@pytest.mark.parametrize("m, knobs", [(64, dict(tile_n=256, stages=4)), (3, dict(tile_n=128, splits=4, stages=6))])
def test_compiled_matches_float64(m, knobs):
    x, w, ref = _operands(np.random.default_rng(m), m, 4096, 1024)
    y = rm.row_matmul(x, w, out_dtype=jnp.float32, **knobs)
    np.testing.assert_allclose(np.asarray(y, np.float64), ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


@pytest.mark.parametrize(
    "x_shape, w_shape, dtype, knobs, match",
    [
        ((65, 128), (64, 128), jnp.bfloat16, {}, "M <= 64"),
        ((8, 100), (64, 100), jnp.bfloat16, {}, "multiple of 64"),
        ((8, 128), (64, 128), jnp.float32, {}, "16-bit"),
        ((8, 128), (96, 128), jnp.bfloat16, dict(tile_n=64), "dividing N"),
        ((8, 192), (64, 192), jnp.bfloat16, dict(tile_n=64, splits=2), "slices"),
        ((8, 1024), (256, 1024), jnp.bfloat16, dict(tile_n=256, stages=8), "shared memory"),
    ],
)
def test_rejects_operands_it_does_not_take(x_shape, w_shape, dtype, knobs, match):
    with pytest.raises(ValueError, match=match):
        rm.row_matmul(jnp.zeros(x_shape, dtype), jnp.zeros(w_shape, dtype), **knobs)
