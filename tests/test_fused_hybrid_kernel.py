"""The fused Pallas hybrid kernel and the Pallas split-K combine (interpret mode) against float64
references of one attention over the concatenated keys.

Unwritten kernel outputs are NaN in the interpreter (see test_tree_attention), so a finite output
that matches the reference also proves every element was written.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.hybrid_attention import hybrid_attention, hybrid_attention_and_write
from pallas_kernels.reference import (
    attention_reference,
    cache_visibility,
    random_tree_mask,
    rotated,
    with_rows_written,
)
from pallas_kernels.split_combine import combine_splits

TOL = dict(rtol=2e-5, atol=2e-5)


def hybrid_inputs(rng, b, t, hq, hkv, s, d, lengths):
    """Random q, cache, new keys (N = T) and a random tree mask per sequence."""
    q = rng.standard_normal((b, t, hq, d), np.float32)
    k_cache, v_cache = (rng.standard_normal((b, s, hkv, d), np.float32) for _ in range(2))
    k_new, v_new = (rng.standard_normal((b, t, hkv, d), np.float32) for _ in range(2))
    return q, k_cache, v_cache, np.asarray(lengths, np.int32), k_new, v_new, random_tree_mask(rng, b, t)


def concatenated_reference(q, k_cache, v_cache, lengths, k_new, v_new, mask):
    visible = np.concatenate([cache_visibility(lengths, q.shape[1], k_cache.shape[1]), mask], axis=-1)
    return attention_reference(q, np.concatenate([k_cache, k_new], 1), np.concatenate([v_cache, v_new], 1), visible)


# (B, T, Hq, Hkv, S, cache lengths, kernel options): SmolLM2's GQA (9 / 3) and plain MHA (4 / 4),
# D = 64; a 21-node tree and one-token steps; an empty cache next to one whose length is no multiple
# of the 64-key tile; one split and several, more splits than a short cache has tiles; 16-row and
# 16-key tiles for several row blocks (66 rows: two combine blocks too) and two tiles of new keys.
CASES = [
    (2, 21, 9, 3, 150, [0, 131], dict(num_splits=3)),
    (2, 1, 4, 4, 100, [70, 1], dict(num_splits=None)),
    (1, 1, 9, 3, 64, [64], dict(num_splits=1)),
    (2, 22, 9, 3, 80, [80, 5], dict(num_splits=4, block_rows=16, block_keys=16)),
    # a roomy cache: 3 of 6 splits hold keys, the new keys' partial goes in slot 3
    (1, 5, 9, 3, 700, [600], dict(num_splits=6)),
]


@pytest.mark.parametrize("b,t,hq,hkv,s,lengths,options", CASES)
def test_hybrid_kernel_matches_attention_over_concatenated_keys(b, t, hq, hkv, s, lengths, options):
    rng = np.random.default_rng([b, t, hq, hkv, s])
    case = hybrid_inputs(rng, b, t, hq, hkv, s, 64, lengths)
    o = np.asarray(hybrid_attention(*(jnp.asarray(x) for x in case), **options))
    want, _ = concatenated_reference(*case)
    assert o.shape == case[0].shape and o.dtype == np.float32
    assert np.isfinite(o).all(), "o has NaN/inf: an element was not written or an empty slice blew up"
    np.testing.assert_allclose(o, want, **TOL)


# (B, T, S, cache lengths, self-visibility of the one-token steps, kernel options): one-token
# steps (AR decoding) with an empty cache next to a long one, one that fills the cache's last row,
# a token that does not see itself; a 3-token block under a tree mask whose new rows cross a
# 16-key tile edge; a 20-token tree at head dim 128 without GQA (the 7B verify's block choice).
SMOLLM2_HEADS, WIDE_HEADS = (9, 3, 64), (4, 4, 128)
WRITE_CASES = [
    (2, 1, 150, [0, 131], [True, True], dict(num_splits=3), SMOLLM2_HEADS),
    (2, 1, 64, [63, 7], [True, False], dict(num_splits=None), SMOLLM2_HEADS),
    (2, 3, 80, [14, 40], None, dict(num_splits=2, block_rows=16, block_keys=16), SMOLLM2_HEADS),
    (1, 20, 200, [90], None, dict(num_splits=2), WIDE_HEADS),
]


@pytest.mark.parametrize("b,t,s,lengths,sees_itself,options,heads", WRITE_CASES)
def test_packed_kernel_rotates_attends_and_writes_the_new_rows(b, t, s, lengths, sees_itself, options, heads):
    """From the un-rotated q|k|v product: the rows written at [len, len + T) are the rotated k
    (to float32 rounding of the rotation) and v (exactly), every other cache row is untouched, and
    o is attention of the rotated q over cache rows [0, len) plus the rotated new keys under the
    mask (float64 reference)."""
    hq, hkv, d = heads
    rng = np.random.default_rng([b, t, s])
    _, k_cache, v_cache, lengths, _, _, mask = hybrid_inputs(rng, b, t, hq, hkv, s, d, lengths)
    if sees_itself is not None:
        mask = np.asarray(sees_itself)[:, None, None]
    qkv = rng.standard_normal((b, t, hq + 2 * hkv, d), np.float32)
    angles = rng.uniform(0, 100, (b, t, d // 2))
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    o, k_out, v_out = hybrid_attention_and_write(
        *(jnp.asarray(x) for x in (qkv, cos, sin, k_cache, v_cache, lengths, mask)), num_heads=hq, **options
    )
    q, k_new = rotated(qkv[:, :, :hq], cos, sin), rotated(qkv[:, :, hq : hq + hkv], cos, sin)
    v_new = qkv[:, :, hq + hkv :]
    np.testing.assert_allclose(np.asarray(k_out), with_rows_written(k_cache, k_new, lengths), rtol=0, atol=1e-6)
    written = np.zeros(k_cache.shape[:2], bool)
    for row, n in enumerate(lengths):
        written[row, n : n + t] = True
    np.testing.assert_array_equal(np.asarray(k_out)[~written], k_cache[~written])
    np.testing.assert_array_equal(np.asarray(v_out), with_rows_written(v_cache, v_new, lengths))
    want, _ = concatenated_reference(q, k_cache, v_cache, lengths, k_new, v_new, mask)
    assert o.shape == (b, t, hq, d) and np.isfinite(np.asarray(o)).all()
    np.testing.assert_allclose(np.asarray(o), want, **TOL)


def test_packed_kernel_rejects_bad_shapes():
    z = lambda *shape: jnp.zeros(shape, jnp.float32)
    args = (z(1, 1, 10, 64), z(1, 1, 32), z(1, 1, 32), z(1, 8, 2, 64), z(1, 8, 2, 64), jnp.ones((1,), jnp.int32))
    with pytest.raises(ValueError, match="must hold 4 \\+ 2 x 2 heads"):
        hybrid_attention_and_write(*args, jnp.ones((1, 1, 1), bool), num_heads=4)
    with pytest.raises(ValueError, match="mask must be"):
        hybrid_attention_and_write(*args, jnp.ones((1, 1, 2), bool), num_heads=6)


def test_hybrid_kernel_row_that_sees_nothing_is_zero():
    """With an empty cache a query whose mask row is all False sees no key at all: o = 0, not NaN;
    the other rows of its KV head and of the other sequence are unaffected."""
    rng = np.random.default_rng(4)
    q, k_cache, v_cache, _, k_new, v_new, mask = hybrid_inputs(rng, 2, 5, 9, 3, 40, 64, [0, 0])
    lengths = np.array([0, 17], np.int32)
    mask[0, 3] = False  # sees nothing
    mask[1, 2] = False  # sees the cache only
    case = (q, k_cache, v_cache, lengths, k_new, v_new, mask)
    o = np.asarray(hybrid_attention(*(jnp.asarray(x) for x in case), num_splits=2))
    want, lse = concatenated_reference(*case)
    assert np.isneginf(lse[0, :, 3]).all() and np.isfinite(o).all()
    assert (o[0, 3] == 0).all()
    np.testing.assert_allclose(o, want, **TOL)


def test_hybrid_kernel_bfloat16_inputs():
    rng = np.random.default_rng(8)
    case = hybrid_inputs(rng, 1, 7, 9, 3, 90, 64, [77])
    as_device = [jnp.asarray(x, jnp.bfloat16) if x.dtype == np.float32 else jnp.asarray(x) for x in case]
    o = hybrid_attention(*as_device, num_splits=2)
    assert o.dtype == jnp.bfloat16
    want, _ = concatenated_reference(*(np.asarray(x, np.float32) if x.dtype == jnp.bfloat16 else x for x in as_device))
    np.testing.assert_allclose(np.asarray(o, np.float32), want, rtol=2e-2, atol=2e-2)


def test_hybrid_kernel_rejects_bad_shapes():
    """Plain ValueError from the kernel layer (the dispatch turns it into a UserError)."""
    z = lambda *shape: jnp.zeros(shape, jnp.float32)
    lengths = jnp.ones((1,), jnp.int32)
    with pytest.raises(ValueError, match="mask must be") as err:
        hybrid_attention(
            z(1, 4, 4, 64),
            z(1, 8, 2, 64),
            z(1, 8, 2, 64),
            lengths,
            z(1, 4, 2, 64),
            z(1, 4, 2, 64),
            jnp.ones((1, 4, 5), bool),
        )
    assert type(err.value) is ValueError
    with pytest.raises(ValueError, match="cache's KV heads"):
        hybrid_attention(
            z(1, 4, 4, 64),
            z(1, 8, 2, 64),
            z(1, 8, 2, 64),
            lengths,
            z(1, 4, 4, 64),
            z(1, 4, 4, 64),
            jnp.ones((1, 4, 4), bool),
        )
    with pytest.raises(ValueError, match="cache_len"):
        hybrid_attention(
            z(1, 4, 4, 64),
            z(1, 8, 2, 64),
            z(1, 8, 2, 64),
            jnp.ones((2,), jnp.int32),
            z(1, 4, 2, 64),
            z(1, 4, 2, 64),
            jnp.ones((1, 4, 4), bool),
        )


@pytest.mark.parametrize(
    "t, num_parts, unused, counted",
    [(3, 5, 0, False), (7, 37, 0, False), (3, 2, 0, False), (7, 37, 6, False), (3, 6, 3, False), (3, 5, 3, True)],
)
def test_combine_equals_attention_over_the_union_of_slices(t, num_parts, unused, counted):
    """P partials over disjoint random key subsets (flash_block's row order): a chunk of parts or
    several (37: the last chunk shifted back over parts already merged), one row block or two;
    rows that only some slices see, a row that no slice sees (o = 0, lse = -inf), and a slice
    nobody sees. `unused` slots past the partials (NaN, as an unwritten output) are not read.
    counted: the combine counts the partials itself from cached lengths (`cut`): 256 keys in 16-key
    tiles of at least 4 a slice are 4 slices, plus one extra part; 600 keys in a 256-row cache count
    as 256 (uncapped they would count 8 + 1, reading the NaN slots)."""
    rng = np.random.default_rng(12 + num_parts)
    b, hq, hkv, n, d = 2, 9, 3, 80, 64
    q = rng.standard_normal((b, t, hq, d))
    k, v = (rng.standard_normal((b, n, hkv, d)) for _ in range(2))
    visible = rng.random((b, t, n)) < 0.5
    visible[1, 2] = False
    part_of_key = rng.integers(0, num_parts - 1, n)  # the last part gets no key
    group = hq // hkv
    o_parts = np.zeros((b, hkv, num_parts, t * group, d))
    lse_parts = np.zeros((b, hkv, num_parts, t * group))
    for p in range(num_parts):
        o_p, lse_p = attention_reference(q, k, v, visible & (part_of_key == p)[None, None, :])
        # [B, T, Hq, D] -> rows [B, Hkv, T * G, D]; [B, Hq, T] -> [B, Hkv, T * G]
        o_parts[:, :, p] = o_p.reshape(b, t, hkv, group, d).transpose(0, 2, 1, 3, 4).reshape(b, hkv, t * group, d)
        lse_parts[:, :, p] = lse_p.reshape(b, hkv, group, t).transpose(0, 1, 3, 2).reshape(b, hkv, t * group)
    nan = np.full((b, hkv, unused, t * group), np.nan)
    o, lse = combine_splits(
        jnp.asarray(np.concatenate([o_parts, np.repeat(nan[..., None], d, -1)], 2), jnp.float32),
        jnp.asarray(np.concatenate([lse_parts, nan], 2), jnp.float32),
        jnp.asarray([256, 600], jnp.int32) if counted else jnp.full((b,), num_parts, jnp.int32),
        num_queries=t,
        out_dtype=jnp.float32,
        with_lse=True,
        interpret=True,
        cut=(8, 16, 1, 256) if counted else None,
    )
    want_o, want_lse = attention_reference(q, k, v, visible)
    o, lse = np.asarray(o), np.asarray(lse)
    assert np.isfinite(o).all() and not np.isnan(lse).any()
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    assert np.isneginf(lse[1, :, 2]).all() and (o[1, 2] == 0).all()
    np.testing.assert_allclose(o, want_o, **TOL)
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[finite], want_lse[finite], **TOL)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="compiled Pallas needs an NVIDIA GPU")
def test_gpu_bfloat16_hybrid_kernel_at_smollm2_shapes():
    """The compiled kernels in bf16 at SmolLM2's verify shape (GQA 9 / 3, D = 64, a 21-node tree):
    cache lengths from empty to full, one query that sees nothing."""
    rng = np.random.default_rng(30)
    case = list(hybrid_inputs(rng, 4, 21, 9, 3, 4096, 64, [0, 1, 2049, 4096]))
    case[6][0, 4] = False
    as_device = [jnp.asarray(x, jnp.bfloat16) if x.dtype == np.float32 else jnp.asarray(x) for x in case]
    o = np.asarray(hybrid_attention(*as_device), np.float32)
    want, _ = concatenated_reference(*(np.asarray(x, np.float32) if x.dtype == jnp.bfloat16 else x for x in as_device))
    assert np.isfinite(o).all() and (o[0, 4] == 0).all()
    assert np.abs(o - want).max() < 2e-2 * np.abs(want).max()
