"""Which products stream their weight on Hopper's units (`streamed_products`): the knobs chosen for each
product of the 7B shapes, and a product so routed (the streamer interpreted on the CPU) against
float64, norm folded in or not."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental.pallas import mosaic_gpu as plgpu

from longspec_jax import attention, streamed_products
from longspec_jax.model import Linear, PackedLinear, RMSNorm
from pallas_kernels import flash_block, row_matmul_mgpu

H100_SMS = 132


def _knobs(rows, n, k):
    return streamed_products.streamer_knobs(rows, n, k, n * k * 2, num_sms=H100_SMS)


@pytest.mark.parametrize(
    "name, n, k, expected",
    [
        # Llama-3-8B: q|k|v 96 strips of 64 columns; o and down 64 strips, two slices; gate|up is wide
        ("llama q|k|v", 6144, 4096, dict(tile_n=64, splits=1, stages=8)),
        ("llama o", 4096, 4096, dict(tile_n=64, splits=2, stages=8)),
        ("llama gate|up", 28672, 4096, None),
        ("llama down", 4096, 14336, dict(tile_n=64, splits=2, stages=8)),
        # Vicuna-7B: q|k|v's 96 strips of 128 columns are wide too; down's 11008 features cut in two
        ("vicuna q|k|v", 12288, 4096, None),
        ("vicuna o", 4096, 4096, dict(tile_n=64, splits=2, stages=8)),
        ("vicuna gate|up", 22016, 4096, None),
        ("vicuna down", 4096, 11008, dict(tile_n=64, splits=2, stages=8)),
    ],
)
def test_a_verify_streams_the_narrow_7b_products(name, n, k, expected):
    assert _knobs(64, n, k) == expected, name
    assert _knobs(17, n, k) == expected, name


@pytest.mark.parametrize("rows", [1, 4, 16, 65, 256])
def test_an_ar_step_a_draft_level_and_a_batched_verify_stay_xla(rows):
    assert _knobs(rows, 4096, 4096) is None


def test_small_weights_and_odd_widths_stay_xla():
    assert _knobs(64, 576, 1536) is None  # a SmolLM2 product: launches bound it, not bytes
    assert _knobs(64, 4096 + 8, 4096) is None  # the strips do not divide the columns
    assert _knobs(64, 4096, 4096 + 64) is None  # 65 tiles of 64 features: no second slice, 64 blocks too few


def _packed(d_in, outs, norm=None):
    rngs = nnx.Rngs(0)
    parts = [Linear(d_in, d_out, bias=False, dtype=jnp.bfloat16, rngs=rngs) for d_out in outs]
    return parts, PackedLinear(parts, (), norm)


@pytest.mark.parametrize("folded_norm", [False, True])
@pytest.mark.parametrize("rows, num_sms, splits", [(17, 4, 1), (64, 4, 1), (64, 8, 2)])
def test_a_streamed_product_equals_float64(monkeypatch, rows, num_sms, splits, folded_norm):
    """Small shapes forced onto the streamer: a GPU of four or eight multiprocessors (four strips, in
    one slice or two), no weight too small; the product is the streamer's (counted) and equals
    norm-then-product in float64."""
    monkeypatch.setattr(attention, "on_hopper", lambda: True)
    monkeypatch.setattr(flash_block, "NUM_SMS", num_sms)
    monkeypatch.setattr(streamed_products, "MIN_WEIGHT_BYTES", 0)
    calls = []
    interpreted = functools.partial(row_matmul_mgpu.row_matmul, interpret=plgpu.InterpretGPUParams())
    monkeypatch.setattr(row_matmul_mgpu, "row_matmul", lambda *a, **kw: calls.append(kw) or interpreted(*a, **kw))
    rng = np.random.default_rng(rows)
    d_in = 256
    norm = None
    if folded_norm:
        norm = RMSNorm(d_in, 1e-5, dtype=jnp.bfloat16)
        norm.weight[...] = jnp.asarray(rng.uniform(0.5, 1.5, d_in), jnp.bfloat16)
    parts, linear = _packed(d_in, (128, 128), norm)
    x = jnp.asarray(rng.normal(size=(1, rows, d_in)), jnp.bfloat16)
    with jax.default_device(jax.devices("cpu")[0]):
        y = linear(x)
    assert [(kw["tile_n"], kw["splits"]) for kw in calls] == [(64, splits)]
    x64 = np.asarray(x, np.float64)
    if folded_norm:
        x64 = x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + 1e-5)
    weight = np.asarray(linear.weight[...], np.float64).T  # the norm's weight folded in, rounded once
    expected = x64 @ weight
    assert y.shape == (1, rows, 256) and y.dtype == jnp.bfloat16
    # bfloat16 operands (the normalised rows rounded once), float32 sums, a bfloat16 result
    np.testing.assert_allclose(np.asarray(y, np.float64), expected, rtol=2e-2, atol=2e-2 * np.abs(expected).max())


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the compiled streamer needs a Hopper GPU")
def test_compiled_streamed_product_equals_float64():
    """A verify's 64 rows against a 7B layer's o product, as the model runs it on a Hopper GPU."""
    _, linear = _packed(4096, (4096,))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 64, 4096)), jnp.bfloat16)
    assert linear._streamed(64, x, linear.weight[...]) == dict(tile_n=64, splits=2, stages=8)
    expected = np.asarray(x, np.float64) @ np.asarray(linear.weight[...], np.float64).T
    y = jax.jit(linear)(x)
    np.testing.assert_allclose(np.asarray(y, np.float64), expected, rtol=2e-2, atol=2e-2 * np.abs(expected).max())
