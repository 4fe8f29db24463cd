"""hybrid_tree_attention == one dense masked attention over the concatenated keys (the identity
the hybrid rests on), for every impl, against a float64 reference; and prefill_attention's impls."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longspec_jax import attention
from longspec_jax.errors import UserError
from pallas_kernels.reference import attention_reference, cache_visibility, random_tree_mask

TOL = dict(rtol=3e-5, atol=3e-5)


def hybrid_case(rng, b, t, hq, hkv, s, d, lengths, kind):
    q = rng.standard_normal((b, t, hq, d), np.float32)
    k_cache = rng.standard_normal((b, s, hkv, d), np.float32)
    v_cache = rng.standard_normal((b, s, hkv, d), np.float32)
    k_new = rng.standard_normal((b, t, hkv, d), np.float32)
    v_new = rng.standard_normal((b, t, hkv, d), np.float32)
    if kind == "tree":
        tree_mask = random_tree_mask(rng, b, t)
    else:
        tree_mask = rng.random((b, t, t)) < 0.5
    return q, k_cache, v_cache, np.asarray(lengths, np.int32), k_new, v_new, tree_mask


def dense_reference(q, k_cache, v_cache, lengths, k_new, v_new, tree_mask):
    mask = np.concatenate([cache_visibility(lengths, q.shape[1], k_cache.shape[1]), tree_mask], axis=-1)
    o, _ = attention_reference(q, np.concatenate([k_cache, k_new], 1), np.concatenate([v_cache, v_new], 1), mask)
    return o


# (B, T, Hq, Hkv, S, D, cache lengths, mask kind): an empty cache next to a full one; arbitrary masks
# include rows that see no new key (then the cache alone decides) and, with an empty cache, rows
# that see nothing at all (o = 0).
CASES = [
    (1, 1, 4, 4, 40, 64, [23], "tree"),
    (2, 16, 8, 2, 90, 64, [0, 90], "tree"),
    (3, 6, 4, 1, 70, 128, [5, 0, 64], "arbitrary"),
]


@pytest.mark.filterwarnings("ignore:cache_attention. cuDNN path unavailable")
@pytest.mark.parametrize("impl", ["xla", "pallas", "cudnn"])
@pytest.mark.parametrize("b,t,hq,hkv,s,d,lengths,kind", CASES)
def test_hybrid_equals_dense_attention_over_concatenated_keys(impl, b, t, hq, hkv, s, d, lengths, kind):
    rng = np.random.default_rng([b, t, hq, hkv, s, d, len(impl)])
    case = hybrid_case(rng, b, t, hq, hkv, s, d, lengths, kind)
    o = attention.hybrid_tree_attention(*(jnp.asarray(x) for x in case), impl=impl)
    o = np.asarray(o)
    assert o.shape == case[0].shape and np.isfinite(o).all()
    np.testing.assert_allclose(o, dense_reference(*case), **TOL)


@pytest.mark.filterwarnings("ignore:prefill_attention. cuDNN path unavailable")
@pytest.mark.parametrize("impl", ["xla", "cudnn", "pallas"])
def test_prefill_attention_is_causal_within_lengths(impl):
    rng = np.random.default_rng(1)
    b, l, hq, hkv, d = 2, 12, 4, 2, 64
    q = rng.standard_normal((b, l, hq, d), np.float32)
    k = rng.standard_normal((b, l, hkv, d), np.float32)
    v = rng.standard_normal((b, l, hkv, d), np.float32)
    lengths = np.array([12, 7], np.int32)
    o = np.asarray(attention.prefill_attention(*(jnp.asarray(x) for x in (q, k, v, lengths)), impl=impl))
    pos = np.arange(l)
    mask = (pos[None, :, None] >= pos[None, None, :]) & (pos[None, None, :] < lengths[:, None, None])
    ref, _ = attention_reference(q, k, v, mask)
    valid = pos[None, :] < lengths[:, None]
    np.testing.assert_allclose(o[valid], ref[valid], **TOL)


def test_default_impl_on_cpu_is_xla_and_unknown_impls_are_user_errors():
    assert attention.default_impl() == "xla"
    assert attention.FASTEST_GPU_IMPL in attention.IMPLS
    z = jnp.zeros((1, 1, 4, 64))
    with pytest.raises(UserError, match="unknown attention impl"):
        attention.hybrid_tree_attention(
            z, z, z, jnp.ones((1,), jnp.int32), z, z, jnp.ones((1, 1, 1), bool), impl="flash"
        )
    with pytest.raises(UserError, match="unknown attention impl"):
        attention.prefill_attention(z, z, z, jnp.ones((1,), jnp.int32), impl="flash")


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN and compiled Pallas need an NVIDIA GPU")
@pytest.mark.parametrize("impl", ["cudnn", "pallas"])
def test_gpu_bfloat16_paths_match_float64_reference(impl):
    """On GPU the same identities in bf16 (compiled Triton kernels, cuDNN with its float32 LSE)."""
    rng = np.random.default_rng(21)
    case = hybrid_case(rng, 2, 74, 32, 8, 1000, 128, [1000, 321], "tree")
    as_device = [jnp.asarray(x, jnp.bfloat16) if x.dtype == np.float32 else jnp.asarray(x) for x in case]
    as_used = [np.asarray(x, np.float32) if x.dtype == jnp.bfloat16 else np.asarray(x) for x in as_device]
    o = np.asarray(attention.hybrid_tree_attention(*as_device, impl=impl), np.float32)
    want = dense_reference(*as_used)
    assert np.abs(o - want).max() < 2e-2 * np.abs(want).max()

    q, k, v = (x[:, :64] for x in (as_device[0], as_device[4], as_device[5]))
    lengths = jnp.asarray([64, 17], jnp.int32)
    o = np.asarray(attention.prefill_attention(q, k, v, lengths, impl=impl), np.float32)
    pos = np.arange(64)
    mask = (pos[None, :, None] >= pos[None, None, :]) & (pos[None, None, :] < np.asarray(lengths)[:, None, None])
    want, _ = attention_reference(*(np.asarray(x, np.float32) for x in (q, k, v)), mask)
    valid = pos[None, :] < np.asarray(lengths)[:, None]
    assert np.abs(o[valid] - want[valid]).max() < 2e-2 * np.abs(want[valid]).max()


def test_kernel_shape_errors_reach_the_user_as_user_errors():
    """The Pallas kernels raise ValueError on shapes they cannot take; through the dispatch the
    user gets a UserError with the kernel's message."""
    q = jnp.zeros((1, 4, 6, 64))
    k = jnp.zeros((1, 4, 4, 64))
    with pytest.raises(UserError, match="multiple of KV heads"):
        attention.masked_attention(q, k, k, jnp.ones((1, 4, 4), bool))
    with pytest.raises(UserError, match="multiple of KV heads"):
        attention.hybrid_tree_attention(
            q, k, k, jnp.full((1,), 2, jnp.int32), k, k, jnp.ones((1, 4, 4), bool), impl="pallas"
        )


def test_kernel_value_errors_become_user_errors(monkeypatch):
    def refuses(*args, **kwargs):
        raise ValueError("masked_attention: a shape it cannot take")

    monkeypatch.setattr(attention.pallas_tree, "masked_attention", refuses)
    with pytest.raises(UserError, match="a shape it cannot take") as caught:
        attention.masked_attention(
            jnp.zeros((1, 4, 4, 64)), *(jnp.zeros((1, 4, 4, 64)),) * 2, jnp.ones((1, 4, 4), bool)
        )
    assert isinstance(caught.value.__cause__, ValueError)
