"""The Mosaic GPU split-K cache attention against float64, in the GPU interpret mode on the CPU:
lengths off the tile grid, an empty sequence, slices without keys, GQA, both head dims, a ring of
two to four slots."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import cache_attention_mgpu as mgpu
from pallas_kernels.reference import attention_reference, cache_visibility

T = mgpu.QUERY_ROWS


@pytest.mark.parametrize(
    "batch, hq, hkv, d, capacity, lengths, knobs",
    [
        (2, 2, 1, 64, 512, [300, 0], dict(num_splits=3, stages=2)),  # GQA; 3 slices of 5 tiles
        (1, 2, 2, 128, 256, [256], dict(num_splits=1, stages=3, block_keys=128)),  # no GQA, full cache
        (2, 3, 1, 64, 1024, [65, 1000], dict(num_splits=4, stages=4)),  # slices with no keys
    ],
)
def test_matches_float64(batch, hq, hkv, d, capacity, lengths, knobs):
    rng = np.random.default_rng(capacity + d)
    q = jnp.asarray(rng.standard_normal((batch, T, hq, d)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((batch, capacity, hkv, d)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((batch, capacity, hkv, d)), jnp.bfloat16)
    o, lse = mgpu.cache_attention(
        q, k, v, jnp.asarray(lengths, jnp.int32), interpret=plgpu.InterpretGPUParams(), **knobs
    )
    ref_o, ref_lse = attention_reference(q, k, v, cache_visibility(lengths, T, capacity))
    assert o.dtype == jnp.bfloat16 and o.shape == q.shape
    # bf16 output and bf16 probabilities into the value product: a few bf16 ulps of |o| <= ~1.
    np.testing.assert_allclose(np.asarray(o, np.float64), ref_o, atol=2e-2)
    seen = np.isfinite(ref_lse)
    np.testing.assert_allclose(np.asarray(lse, np.float64)[seen], ref_lse[seen], atol=2e-3)
    assert np.all(np.isneginf(np.asarray(lse)[~seen])) and np.all(np.asarray(o)[~seen.any(axis=(1, 2))] == 0)


def test_merge_weighs_partials_by_their_lse():
    rng = np.random.default_rng(1)
    o_parts = rng.standard_normal((1, 2, 3, T, 8)).astype(np.float32)
    lse_parts = rng.standard_normal((1, 2, 3, T)).astype(np.float32)
    lse_parts[:, :, 2] = -np.inf  # a slice that held no keys
    o, lse = mgpu.merge_partials(jnp.asarray(o_parts), jnp.asarray(lse_parts), jnp.float32)
    w = np.exp(lse_parts.astype(np.float64))
    expected = (w[..., None] * o_parts).sum(axis=2) / w.sum(axis=2)[..., None]
    np.testing.assert_allclose(np.asarray(o), expected.transpose(0, 2, 1, 3), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), np.log(w.sum(axis=2)), rtol=1e-5)


@pytest.mark.parametrize("q_shape", [(1, 16, 2, 64), (1, 64, 8, 64)])  # 16 queries; a group of 8
def test_rejects_shapes_it_does_not_take(q_shape):
    q = jnp.zeros(q_shape, jnp.bfloat16)
    k = jnp.zeros((1, 128, 1, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="needs 64 queries"):
        mgpu.cache_attention(q, k, k, jnp.ones((1,), jnp.int32))


@pytest.mark.parametrize("group", range(1, mgpu.MAX_GROUP + 1))
def test_register_split_fits_the_blocks_start(group):
    compute, load = mgpu._registers(group)
    start = 65536 // (128 * (group + 1)) // 8 * 8  # an even split of the SM's registers, 8 at a time
    assert compute * group + load <= start * (group + 1)
    assert compute % 8 == 0 and load % 8 == 0 and 64 <= compute <= 232 and load >= 24
