"""Cache attention with LSE (Pallas split-K kernel in interpret mode, and the attention-op
dispatch) and the LSE merge, against float64 references.

Unwritten kernel outputs are NaN in the interpreter (see test_tree_attention), so matching the
finite reference also proves every element was written, including by splits past a sequence's end.
"""

import contextlib

import jax.numpy as jnp
import numpy as np
import pytest

from longspec_jax import attention
from longspec_jax.errors import UserError
from pallas_kernels.cache_attention import (
    MIN_TILES_PER_SPLIT,
    SMALL_BLOCK_TARGET_PROGRAMS,
    TARGET_PROGRAMS,
    default_num_splits,
    split_grid,
    split_plan,
)
from pallas_kernels.cache_attention import cache_attention as pallas_cache_attention
from pallas_kernels.flash_block import NUM_SMS
from pallas_kernels.reference import attention_reference, cache_visibility

TOL = dict(rtol=2e-5, atol=2e-5)


def random_cache_case(rng, b, t, hq, hkv, s, d, lengths):
    q = rng.standard_normal((b, t, hq, d), np.float32)
    k = rng.standard_normal((b, s, hkv, d), np.float32)
    v = rng.standard_normal((b, s, hkv, d), np.float32)
    return q, k, v, np.asarray(lengths, np.int32)


def assert_cache_result(o, lse, q, k, v, lengths):
    ref_o, ref_lse = attention_reference(q, k, v, cache_visibility(lengths, q.shape[1], k.shape[1]))
    o, lse = np.asarray(o), np.asarray(lse)
    assert o.shape == q.shape and lse.shape == ref_lse.shape and lse.dtype == np.float32
    assert np.isfinite(o).all() and not np.isnan(lse).any()
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    np.testing.assert_allclose(o, ref_o, **TOL)
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], **TOL)


# (B, T, Hq, Hkv, S, D, cache lengths, num_splits): lengths not multiples of the 64-key tile,
# an empty sequence, a full one, more splits than a short sequence has tiles.
CASES = [
    (1, 1, 4, 4, 70, 64, [70], None),
    (3, 4, 8, 2, 300, 128, [0, 117, 300], 3),
    (2, 16, 8, 1, 200, 64, [1, 131], 4),
    (1, 74, 4, 1, 100, 64, [77], 2),
    (1, 128, 2, 2, 90, 128, [90], None),
    # a roomy cache: 2 and 4 of 8 splits hold keys, then all 8
    (2, 3, 8, 2, 1024, 64, [300, 1024], 8),
    (1, 2, 4, 2, 2048, 64, [2048], 8),
]


@pytest.mark.parametrize("b,t,hq,hkv,s,d,lengths,num_splits", CASES)
def test_pallas_cache_attention_matches_float64_reference(b, t, hq, hkv, s, d, lengths, num_splits):
    rng = np.random.default_rng([b, t, hq, hkv, s, d])
    q, k, v, lengths = random_cache_case(rng, b, t, hq, hkv, s, d, lengths)
    o, lse = pallas_cache_attention(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(lengths), num_splits=num_splits
    )
    assert_cache_result(o, lse, q, k, v, lengths)


def test_lengths_past_the_capacity_read_the_whole_cache():
    """A length past S counts as S, in the kernels and in the combine's count of partials (which
    each takes from the length itself): the same result as a length of S, against float64."""
    rng = np.random.default_rng(9)
    q, k, v, lengths = random_cache_case(rng, 2, 3, 8, 2, 300, 64, [300, 130])
    args = (jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
    o, lse = pallas_cache_attention(*args, jnp.asarray([300 + 77, 130], jnp.int32), num_splits=4)
    assert_cache_result(o, lse, q, k, v, lengths)
    want, _ = pallas_cache_attention(*args, jnp.asarray(lengths), num_splits=4)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(want))


@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_split_plan_cuts_every_length_into_at_most_num_splits_slices_of_enough_tiles(num_splits):
    lengths = jnp.arange(0, 3000, dtype=jnp.int32)
    num_tiles, per_split, used = (np.asarray(x) for x in split_plan(lengths, num_splits, 64))
    tiles = -(-np.asarray(lengths) // 64)
    np.testing.assert_array_equal(num_tiles, tiles)
    assert (used <= num_splits).all() and (per_split >= MIN_TILES_PER_SPLIT).all()
    assert (used * per_split >= tiles).all(), "a tile no split folds"
    assert ((used - 1) * per_split < tiles)[tiles > 0].all(), "a split counted as used holds no tile"
    assert (used[tiles == 0] == 0).all()


@pytest.mark.parametrize("programs_per_split", [1, 3, 6, 24, 32, 200])
@pytest.mark.parametrize("capacity", [64, 1024, 5012, 8192, 65536])
@pytest.mark.parametrize("extra_parts", [0, 1])
def test_default_num_splits_keeps_a_capacity_bound_grid_to_one_wave_if_half_a_cache_fits(
    programs_per_split, capacity, extra_parts
):
    block_keys = 64
    splits = default_num_splits(programs_per_split, capacity, block_keys, extra_parts)
    full = max(1, capacity // (MIN_TILES_PER_SPLIT * block_keys))
    want = -(-TARGET_PROGRAMS // programs_per_split)
    assert 1 <= splits <= max(want, 1)
    if want <= full:  # the capacity does not bound it: the target's count
        assert splits == want
    else:
        assert max(1, full // 2) <= splits <= full
        fits_one_wave = (splits + extra_parts) * programs_per_split <= NUM_SMS
        assert fits_one_wave or splits == max(1, full // 2)
        # No fewer than one wave allows: what fits, up to the capacity's count, is kept.
        assert splits == full or (splits + 1 + extra_parts) * programs_per_split > NUM_SMS or splits == 1


@pytest.mark.parametrize(
    "t,hq,hkv,d,target",
    [
        (1, 32, 8, 128, SMALL_BLOCK_TARGET_PROGRAMS),
        (1, 32, 32, 128, SMALL_BLOCK_TARGET_PROGRAMS),
        (4, 32, 8, 128, SMALL_BLOCK_TARGET_PROGRAMS),
        (64, 32, 8, 128, TARGET_PROGRAMS),
        (5, 32, 8, 128, TARGET_PROGRAMS),
        (1, 9, 3, 64, TARGET_PROGRAMS),
    ],
)
def test_split_grid_aims_a_wide_ar_steps_small_blocks_at_one_wave(t, hq, hkv, d, target):
    """At head dim 128, row blocks of at most 16 rows (an AR step: a KV head's group of query heads)
    aim at one wave of programs; larger ones (a verified tree) and head dim 64 at TARGET_PROGRAMS.
    The cache is roomy enough to bound neither."""
    q = jnp.zeros((1, t, hq, d), jnp.bfloat16)
    cache = jnp.zeros((1, 65536, hkv, d), jnp.bfloat16)
    _, _, _, row_blocks, splits = split_grid(q, cache, 64, 64, None)
    assert splits == -(-target // (hkv * row_blocks))


def test_pallas_cache_attention_small_tiles_many_splits():
    """16-row / 16-key tiles: several row blocks and several tiles per split."""
    rng = np.random.default_rng(3)
    q, k, v, lengths = random_cache_case(rng, 2, 9, 4, 2, 150, 64, [150, 40])
    o, lse = pallas_cache_attention(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(lengths), block_rows=16, block_keys=16, num_splits=3
    )
    assert_cache_result(o, lse, q, k, v, lengths)


@pytest.mark.parametrize("impl", ["xla", "cudnn"])
def test_cache_attention_dispatch(impl):
    """Off GPU, "cudnn" falls back to the XLA path (with a warning) and must still be exact."""
    rng = np.random.default_rng(5)
    q, k, v, lengths = random_cache_case(rng, 2, 3, 4, 2, 50, 64, [0, 33])
    with pytest.warns(UserWarning, match="cuDNN") if impl == "cudnn" else contextlib.nullcontext():
        o, lse = attention.cache_attention(
            jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(lengths), impl=impl
        )
    assert_cache_result(o, lse, q, k, v, lengths)


def test_cache_attention_rejects_unknown_impl_and_bad_lengths():
    q = jnp.zeros((2, 1, 4, 64))
    k = jnp.zeros((2, 8, 4, 64))
    with pytest.raises(UserError, match="unknown attention impl"):
        attention.cache_attention(q, k, k, jnp.zeros((2,), jnp.int32), impl="flash")
    with pytest.raises(ValueError, match="cache_len") as err:  # the kernel layer's own error type
        pallas_cache_attention(q, k, k, jnp.zeros((3,), jnp.int32))
    assert type(err.value) is ValueError


def test_merge_attention_equals_attention_over_the_union():
    """Keys split into two disjoint random sets; some rows see only one side, one row neither."""
    rng = np.random.default_rng(9)
    b, t, hq, hkv, n, d = 2, 5, 4, 2, 24, 64
    q = rng.standard_normal((b, t, hq, d))
    k = rng.standard_normal((b, n, hkv, d))
    v = rng.standard_normal((b, n, hkv, d))
    mask = rng.random((b, t, n)) < 0.5
    side = rng.random((b, t, n)) < 0.5
    mask_c, mask_s = mask & side, mask & ~side
    mask_c[0, 1], mask_s[0, 2] = False, False  # one side empty
    mask_c[1, 3], mask_s[1, 3] = False, False  # both empty
    o_c, lse_c = attention_reference(q, k, v, mask_c)
    o_s, lse_s = attention_reference(q, k, v, mask_s)
    o = attention.merge_attention(*(jnp.asarray(x, jnp.float32) for x in (o_c, lse_c, o_s, lse_s)))
    ref_o, _ = attention_reference(q, k, v, mask_c | mask_s)
    assert np.isfinite(np.asarray(o)).all()
    np.testing.assert_allclose(np.asarray(o), ref_o, **TOL)
    assert (np.asarray(o)[1, 3] == 0).all()
