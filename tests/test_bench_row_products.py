"""bench_row_products' bookkeeping on the CPU: each 7B product's (N, K) from the model's config, which
streamer knobs fit a product, and the timing loop on XLA's product (the streamer itself needs a
Hopper GPU; its correctness is tests/test_row_matmul_mgpu.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from benchmarks import bench_row_products as bench
from benchmarks import floors
from longspec_jax.int8_rows import quantized_rows
from longspec_jax.model import Transformer
from longspec_jax.model_shapes import MODEL_SHAPES
from tests.tiny_models import tiny_config


def test_product_shapes_are_the_packed_layouts_matrices(monkeypatch):
    config = tiny_config()
    model = Transformer(config, dtype=jnp.float32, rngs=nnx.Rngs(0)).inference_layout()
    layer = model.layers[0]
    packed = {
        "qkv": layer.self_attn.qkv_proj.weight.shape,
        "o": layer.self_attn.o_proj.weight.shape,
        "gate_up": layer.mlp.gate_up_proj.weight.shape,
        "down": layer.mlp.down_proj.weight.shape,
    }
    monkeypatch.setitem(MODEL_SHAPES, "_tiny", config)
    assert bench.product_shapes("_tiny") == packed
    assert bench.product_shapes("llama31_8b") == {
        "qkv": (6144, 4096),
        "o": (4096, 4096),
        "gate_up": (28672, 4096),
        "down": (4096, 14336),
    }


@pytest.mark.parametrize(
    "config, n, k, fits",
    [((128, 1, 8), 4096, 4096, True), ((256, 1, 4), 4160, 4096, False), ((128, 4, 8), 4096, 11008, True),
     ((128, 8, 8), 4096, 11008, False)],
)  # fmt: skip
def test_fits(config, n, k, fits):
    assert bench.fits(config, n, k) is fits


def test_time_product_runs_every_matrix():
    weights = [jnp.full((64, 128), i + 1, jnp.bfloat16) for i in range(3)]
    seconds = bench.time_product(bench.xla_product, weights, rows=4, repeats=2)
    assert np.isfinite(seconds) and seconds > 0


def test_the_int8_products_equal_the_scaled_rows_and_are_timed():
    """XLA's product, XLA's over the rows' int8 parts and fused_linear (interpreted here) over the same
    int8 rows; --int8's records."""
    weights = [0.02 * jax.random.normal(jax.random.key(i), (64, 128), jnp.bfloat16) for i in range(2)]
    rows8, scale = quantized_rows(weights[0])
    x = jax.random.normal(jax.random.key(9), (4, 128), jnp.bfloat16)
    want = np.asarray(x, np.float64) @ (np.asarray(rows8, np.float64) * np.asarray(scale, np.float64)[:, None]).T
    for product in (bench.xla_int8_product, bench.xla_parts_int8_product, bench.kernel_int8_product):
        got = np.asarray(product(x, (rows8, scale)), np.float64)
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())
    records = bench.run_int8("tiny", "o", weights, [1, 4], 1, floors.Rates(bandwidth=1e12, matmul=1e14))
    assert [r["rows"] for r in records] == [1, 4] and all(
        r["xla_us"] > 0 and r["xla_parts_us"] > 0 and r["kernel_us"] > 0 for r in records
    )


def test_the_reduction_equals_the_product_and_both_are_timed_written_out():
    """--reduction: the multiply-reduce product (PackedLinear's small rows) against float64, and its
    records beside XLA's at each row count."""
    weights = [0.02 * jax.random.normal(jax.random.key(i), (64, 128), jnp.bfloat16) for i in range(2)]
    x = jax.random.normal(jax.random.key(9), (3, 128), jnp.bfloat16)
    want = np.asarray(x, np.float64) @ np.asarray(weights[0], np.float64).T
    for product in (bench.reduced_product, bench.written_out(bench.reduced_product), bench.xla_product):
        got = np.asarray(product(x, weights[0]), np.float64)
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())
    records = bench.run_reduction("tiny", "o", weights, [1, 3], 1, floors.Rates(bandwidth=1e12, matmul=1e14))
    assert [r["rows"] for r in records] == [1, 3] and all(r["xla_us"] > 0 and r["reduction_us"] > 0 for r in records)


@pytest.mark.parametrize("splits", [1, 2, 4])
def test_the_k_slices_partials_sum_to_the_product_and_are_timed(splits):
    """--xla-splits: the float32 partials of K's slices sum to the product (float64), and each slice
    count gets its time in the records."""
    weights = [0.02 * jax.random.normal(jax.random.key(i), (64, 128), jnp.bfloat16) for i in range(2)]
    x = jax.random.normal(jax.random.key(9), (5, 128), jnp.bfloat16)
    parts = bench.xla_split_product(splits)(x, weights[0])
    assert parts.shape == (splits, 5, 64) and parts.dtype == jnp.float32
    want = np.asarray(x, np.float64) @ np.asarray(weights[0], np.float64).T
    np.testing.assert_allclose(np.asarray(parts, np.float64).sum(0), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    rates = floors.Rates(bandwidth=1e12, matmul=1e14)
    records = bench.run_xla_splits("tiny", "o", weights, [1, 5], [1, splits], 1, rates)
    assert [r["rows"] for r in records] == [1, 5]
    assert all(sorted(r["split_us"]) == sorted({1, splits}) and min(r["split_us"].values()) > 0 for r in records)
