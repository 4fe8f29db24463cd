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


def test_a_verify_sums_the_streamed_partials_in_its_norm_kernels(monkeypatch):
    """A verified block whose o and down products stream (forced as above: a GPU of four
    multiprocessors, no weight too small, the streamer interpreted) runs each residual add and the
    norm after it as one `residual_norm` kernel that takes the streamer's partials (two a layer),
    and gives the logits and block K/V of XLA's adds and norms over the same streamed products."""
    from longspec_jax import model as model_module
    from longspec_jax.model import init_cache
    from longspec_jax.target import random_target
    from tests.tiny_models import tiny_config

    monkeypatch.setattr(attention, "on_hopper", lambda: True)
    monkeypatch.setattr(flash_block, "NUM_SMS", 4)
    monkeypatch.setattr(streamed_products, "MIN_WEIGHT_BYTES", 0)
    monkeypatch.setattr(model_module, "SCALE_AFTER_MAX_WIDTH", 64)  # norms scale inputs, as at a 7B's width
    interpreted = functools.partial(row_matmul_mgpu.row_matmul, interpret=plgpu.InterpretGPUParams())
    monkeypatch.setattr(row_matmul_mgpu, "row_matmul", interpreted)
    # o: 128 x 256 and down: 128 x 256 stream in two slices; q|k|v and gate|up (512 columns) are wide
    config = tiny_config(hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2, head_dim=64)
    model = random_target(config, seed=5, dtype="bfloat16").model.inference_layout()
    rng = np.random.default_rng(5)
    model.norm.weight[...] = jnp.asarray(rng.uniform(0.5, 2.0, size=config.hidden_size), jnp.bfloat16)
    t, prefix = 20, 7  # a verify's rows: the streamer takes 17-64
    assert all(layer.streams_residuals(t, jnp.bfloat16) for layer in model.layers)
    cache = init_cache(config, 1, 32, jnp.bfloat16)
    cache = model.prefill(jnp.asarray(rng.integers(0, 128, (1, prefix)), jnp.int32), jnp.asarray([prefix]), cache)[1]
    tokens = jnp.asarray(rng.integers(0, 128, (1, t)), jnp.int32)
    positions = jnp.asarray(prefix + np.arange(t)[None], jnp.int32)
    mask = jnp.asarray(np.tril(np.ones((1, t, t), bool)))

    calls, kernel = [], model_module.residual_norm
    monkeypatch.setattr(
        model_module, "residual_norm", lambda *a, **kw: calls.append(kw["partials"]) or kernel(*a, **kw)
    )
    outputs = {}
    with jax.default_device(jax.devices("cpu")[0]):
        for norm_kernels in (True, False):
            model.norm_kernels = norm_kernels
            calls.clear()
            logits, verified, _ = model.forward_block(tokens, positions, mask, cache, attn_impl="pallas")
            outputs[norm_kernels] = (np.asarray(logits), verified)
            assert calls == ([True] * 2 * config.num_layers if norm_kernels else [])
    (logits, verified), (logits_x, verified_x) = outputs[True], outputs[False]
    np.testing.assert_allclose(logits, logits_x, rtol=3e-2, atol=3e-2 * np.abs(logits_x).max())
    for got, want in zip(verified.k + verified.v, verified_x.k + verified_x.v):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)
