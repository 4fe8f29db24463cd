"""The Mosaic GPU split-K cache attention against float64, in the GPU interpret mode on the CPU:
lengths off the tile grid, an empty sequence, slices without keys, blocks of one query head and of
two taking turns (even groups, up to eight), both head dims, both tile sizes, a ring of two to four
slots."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import cache_attention_mgpu as mgpu
from pallas_kernels.reference import attention_reference, block_visibility, cache_visibility, random_tree_mask

T = mgpu.QUERY_ROWS


@pytest.mark.parametrize(
    "batch, hq, hkv, d, capacity, lengths, knobs",
    [
        (2, 2, 1, 64, 512, [300, 0], dict(num_splits=3, stages=2, block_keys=64)),  # a pair; 3 slices of 5 tiles
        (1, 2, 2, 128, 256, [256], dict(num_splits=1, stages=3)),  # no GQA: single heads, full cache
        (2, 3, 1, 64, 1024, [65, 1000], dict(num_splits=4, stages=4, block_keys=64)),  # odd group; empty slices
        (1, 8, 2, 128, 2048, [1500], dict(num_splits=2)),  # two pairs a group of 4, 128-key tiles
    ],
)
def test_matches_float64(batch, hq, hkv, d, capacity, lengths, knobs):
    with jax.default_device(jax.devices("cpu")[0]):  # the interpreter runs on the CPU, GPU or not
        _matches_float64(batch, hq, hkv, d, capacity, lengths, knobs)


def _matches_float64(batch, hq, hkv, d, capacity, lengths, knobs):
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


def _with_block(rng, batch, hq, hkv, d, capacity, lengths):
    """Operands with a block of T keys at cache rows [length, length + T) under a tree mask, and the
    float64 reference over the cache and that block."""
    q = jnp.asarray(rng.standard_normal((batch, T, hq, d)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((batch, capacity, hkv, d)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((batch, capacity, hkv, d)), jnp.bfloat16)
    mask = np.asarray(random_tree_mask(rng, batch, T))
    reference = attention_reference(q, k, v, block_visibility(lengths, mask, capacity))
    return (q, k, v, jnp.asarray(lengths, jnp.int32), jnp.asarray(mask)), reference


@pytest.mark.parametrize(
    "hq, hkv, lengths, knobs",
    [
        (4, 1, [0, 300], dict(num_splits=3)),  # a pair; a sequence whose block is all it sees
        (3, 3, [129, 900], dict(num_splits=2, stages=3)),  # single heads
    ],
)
def test_block_mask_folds_the_queries_own_keys(hq, hkv, lengths, knobs):
    """The verify's tree: the block's own keys, already written after the cache, under its mask."""
    with jax.default_device(jax.devices("cpu")[0]):
        (q, k, v, lens, mask), (ref_o, ref_lse) = _with_block(np.random.default_rng(5), 2, hq, hkv, 64, 1024, lengths)
        o, lse = mgpu.cache_attention(q, k, v, lens, block_mask=mask, interpret=plgpu.InterpretGPUParams(), **knobs)
        np.testing.assert_allclose(np.asarray(o, np.float64), ref_o, atol=2e-2)
        np.testing.assert_allclose(np.asarray(lse, np.float64), ref_lse, atol=2e-3)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the compiled Mosaic GPU kernel needs a Hopper GPU")
@pytest.mark.parametrize(
    "hq, hkv, d, lengths, knobs",
    [
        (32, 8, 128, [4133, 0], dict()),  # Llama-3's group of 4: pairs; a length off the tile grid
        (6, 6, 64, [700, 4224], dict(block_keys=64, stages=4, num_splits=3)),  # single heads
        (12, 4, 128, [1, 2000], dict(num_splits=16)),  # odd group; slices without keys
    ],
)
def test_compiled_matches_float64(hq, hkv, d, lengths, knobs):
    """The probabilities from registers (the interpreter takes them through shared memory)."""
    rng = np.random.default_rng(hq + d)
    capacity = 4224
    q = jnp.asarray(rng.standard_normal((2, T, hq, d)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((2, capacity, hkv, d)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((2, capacity, hkv, d)), jnp.bfloat16)
    o, lse = mgpu.cache_attention(q, k, v, jnp.asarray(lengths, jnp.int32), **knobs)
    ref_o, ref_lse = attention_reference(q, k, v, cache_visibility(lengths, T, capacity))
    np.testing.assert_allclose(np.asarray(o, np.float64), ref_o, atol=2e-2)
    seen = np.isfinite(ref_lse)
    np.testing.assert_allclose(np.asarray(lse, np.float64)[seen], ref_lse[seen], atol=2e-3)
    assert np.all(np.isneginf(np.asarray(lse)[~seen]))


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the compiled Mosaic GPU kernel needs a Hopper GPU")
@pytest.mark.parametrize("hq, hkv, d", [(32, 8, 128), (6, 6, 64)])
def test_compiled_block_mask_matches_float64(hq, hkv, d):
    (q, k, v, lens, mask), (ref_o, ref_lse) = _with_block(np.random.default_rng(6), 2, hq, hkv, d, 4224, [0, 4133])
    o, lse = mgpu.cache_attention(q, k, v, lens, block_mask=mask)
    np.testing.assert_allclose(np.asarray(o, np.float64), ref_o, atol=2e-2)
    np.testing.assert_allclose(np.asarray(lse, np.float64), ref_lse, atol=2e-3)


@pytest.mark.parametrize("q_shape, dtype", [((1, 16, 2, 64), jnp.bfloat16), ((1, 64, 2, 64), jnp.float32)])
def test_rejects_operands_it_does_not_take(q_shape, dtype):
    q = jnp.zeros(q_shape, dtype)
    k = jnp.zeros((1, 128, 1, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="needs 64 queries"):
        mgpu.cache_attention(q, k, k, jnp.ones((1,), jnp.int32))


@pytest.mark.parametrize("pair", [1, 2])
def test_register_split_fits_the_blocks_start(pair):
    compute, load = mgpu._registers(pair)
    start = 65536 // (128 * (pair + 1)) // 8 * 8  # an even split of the SM's registers, 8 at a time
    assert compute * pair + load <= start * (pair + 1)
    assert compute % 8 == 0 and load % 8 == 0 and 64 <= compute <= 232 and load >= 24
