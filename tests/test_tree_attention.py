"""The Pallas masked speculative-attention kernel (interpret mode) against a float64 reference.

The Pallas interpreter fills every output element a kernel does not store with NaN
(test_interpreter_poisons_unwritten_outputs holds it to that), so an element the kernel forgot to
write cannot match the finite reference: each comparison below also checks that all were written.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas_kernels.reference import attention_reference, random_tree_mask
from pallas_kernels.tree_attention import masked_attention

TOL = dict(rtol=2e-5, atol=2e-5)


def random_qkv(rng, b, t, hq, hkv, n, d):
    q = rng.standard_normal((b, t, hq, d), np.float32)
    k = rng.standard_normal((b, n, hkv, d), np.float32)
    v = rng.standard_normal((b, n, hkv, d), np.float32)
    return q, k, v


def arbitrary_mask(rng, b, t, n):
    """Random visibility with some fully masked rows (one per sequence at least)."""
    mask = rng.random((b, t, n)) < 0.4
    mask[:, rng.integers(0, t)] = False
    return mask


def assert_matches_reference(o, lse, q, k, v, mask, scale=None):
    ref_o, ref_lse = attention_reference(q, k, v, mask, scale)
    o, lse = np.asarray(o), np.asarray(lse)
    assert o.shape == q.shape and lse.shape == ref_lse.shape and lse.dtype == np.float32
    assert np.isfinite(o).all(), "o has NaN/inf: an element was not written or a masked row blew up"
    assert not np.isnan(lse).any()
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    np.testing.assert_allclose(o, ref_o, **TOL)
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], **TOL)
    assert (o[np.isneginf(ref_lse).transpose(0, 2, 1)] == 0).all(), "fully masked rows must give o = 0"


def test_interpreter_poisons_unwritten_outputs():
    def writes_nothing(x_ref, o_ref):
        del x_ref, o_ref

    out = pl.pallas_call(writes_nothing, out_shape=jax.ShapeDtypeStruct((16, 16), jnp.float32), interpret=True)(
        jnp.zeros((16, 16), jnp.float32)
    )
    assert np.isnan(np.asarray(out)).all()


# (B, T, Hq, Hkv, N, D, mask kind): T over {1, 4, 16, 74, 128}, GQA ratios 1/4/8, D 64/128, N not a
# multiple of the 64-key tile, row counts T * G not a multiple of the 64-row block.
CASES = [
    (1, 1, 4, 4, 1, 64, "tree"),
    (2, 4, 8, 2, 4, 128, "tree"),
    (3, 16, 8, 1, 16, 64, "arbitrary"),
    (1, 74, 4, 1, 74, 64, "tree"),
    (2, 74, 2, 2, 90, 128, "arbitrary"),
    (1, 128, 8, 1, 130, 64, "arbitrary"),
]


@pytest.mark.parametrize("b,t,hq,hkv,n,d,kind", CASES)
def test_masked_attention_matches_float64_reference(b, t, hq, hkv, n, d, kind):
    rng = np.random.default_rng([b, t, hq, hkv, n, d])
    q, k, v = random_qkv(rng, b, t, hq, hkv, n, d)
    if kind == "tree":
        # Tree verification: the N = T new keys are the tree's own nodes.
        mask = random_tree_mask(rng, b, t)
    else:
        mask = arbitrary_mask(rng, b, t, n)
    o, lse = masked_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask))
    assert_matches_reference(o, lse, q, k, v, mask)


def test_masked_attention_small_blocks_and_scale():
    """Several key tiles and row blocks per program (16-wide), a custom scale."""
    rng = np.random.default_rng(7)
    q, k, v = random_qkv(rng, 2, 9, 4, 2, 37, 64)
    mask = arbitrary_mask(rng, 2, 9, 37)
    o, lse = masked_attention(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask), scale=0.3, block_rows=16, block_keys=16
    )
    assert_matches_reference(o, lse, q, k, v, mask, scale=0.3)


def test_masked_attention_bfloat16_inputs():
    rng = np.random.default_rng(11)
    q, k, v = random_qkv(rng, 1, 16, 4, 1, 16, 64)
    mask = random_tree_mask(rng, 1, 16)
    as_bf16 = lambda x: jnp.asarray(x, jnp.bfloat16)
    o, lse = masked_attention(as_bf16(q), as_bf16(k), as_bf16(v), jnp.asarray(mask))
    assert o.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    ref_o, ref_lse = attention_reference(*(np.asarray(as_bf16(x), np.float32) for x in (q, k, v)), mask)
    np.testing.assert_allclose(np.asarray(o, np.float32), ref_o, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(np.asarray(lse), ref_lse, rtol=1e-2, atol=1e-2)


def test_masked_attention_rejects_bad_shapes():
    """The kernel layer raises plain ValueError (it knows nothing of longspec_jax's UserError)."""
    q = jnp.zeros((1, 4, 6, 64))
    k = jnp.zeros((1, 4, 4, 64))
    with pytest.raises(ValueError, match="multiple of KV heads") as err:
        masked_attention(q, k, k, jnp.ones((1, 4, 4), bool))
    assert type(err.value) is ValueError
    with pytest.raises(ValueError, match="mask must be"):
        masked_attention(q[:, :, :4], k, k, jnp.ones((1, 4, 5), bool))
    with pytest.raises(ValueError, match="head dim"):
        masked_attention(
            jnp.zeros((1, 4, 4, 96)), jnp.zeros((1, 4, 4, 96)), jnp.zeros((1, 4, 4, 96)), jnp.ones((1, 4, 4), bool)
        )
