"""The inference layout (packed q/k/v and gate/up) and the one-token decode path of the target.

Packed and unpacked models must compute the same function (float32, up to rounding order) on every
path the decoders use: prefill, a block forward under a tree mask (verification), one-token steps;
and greedy generation must give the same tokens.
"""

import functools
import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from longspec_jax import attention
from longspec_jax.errors import UserError
from longspec_jax.generation import generate
from longspec_jax.model import PackedAttentionProjections, PackedMLP, init_cache
from longspec_jax.rope import rotate
from longspec_jax.target import Target, random_target
from pallas_kernels.reference import attention_reference, cache_visibility, random_tree_mask
from tests.tiny_models import tiny_config

# The packed layout sums in another order and folds each norm's weight into the product after it
# (one float32 rounding of weight x norm weight): O(1) logits move by up to ~2e-5.
ATOL = 3e-5
MAX_LEN = 32


def scaled_target(seed=0, **config):
    """A tiny random float32 target with matrices at std ~0.2 (O(1) logits) and random norms and
    biases, so a misplaced bias or norm weight in the packing shows."""
    target = random_target(tiny_config(**config), seed=seed, dtype="float32")
    _, params = nnx.split(target.model)
    keys = iter(jax.random.split(jax.random.key(seed + 100), len(jax.tree.leaves(params))))
    nnx.update(
        target.model,
        jax.tree.map(lambda x: x * 10.0 if x.ndim == 2 else x + 0.3 * jax.random.normal(next(keys), x.shape), params),
    )
    return target


def packed_target(target) -> Target:
    return Target(target.config, target.model.inference_layout(), target.tokenizer)


@pytest.fixture(
    scope="module", params=[{}, {"qkv_bias": True, "mlp_bias": True, "o_bias": True}], ids=["llama", "bias"]
)
def pair(request):
    target = scaled_target(seed=3, **request.param)
    return target, packed_target(target)


@functools.partial(jax.jit, static_argnums=0)
def _prefill(graphdef, params, tokens, lengths, cache):
    return nnx.merge(graphdef, params).prefill(tokens, lengths, cache, attn_impl="xla")


@functools.partial(jax.jit, static_argnums=0)
def _block(graphdef, params, tokens, positions, mask, cache):
    return nnx.merge(graphdef, params).forward_block(tokens, positions, mask, cache, attn_impl="xla")


def prefill(target, tokens, lengths):
    cache = init_cache(target.config, tokens.shape[0], MAX_LEN, jnp.float32)
    return _prefill(*nnx.split(target.model), jnp.asarray(tokens), jnp.asarray(lengths), cache)


def block(target, tokens, positions, mask, cache):
    return _block(*nnx.split(target.model), jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(mask), cache)


def assert_caches_close(a, b, lengths):
    for x, y in zip(a.k + a.v, b.k + b.v):
        for row, n in enumerate(lengths):
            np.testing.assert_allclose(np.asarray(x[row, :n]), np.asarray(y[row, :n]), atol=ATOL, rtol=0)


def test_packing_in_place_lets_go_of_each_layer_before_the_next(monkeypatch):
    """A target packed for decoding never holds two layouts of more than one layer at a time."""
    from longspec_jax import model as model_module

    target = random_target(tiny_config(num_layers=4), seed=0, dtype="float32")
    loaded = [weakref.ref(layer.mlp.gate_proj.kernel[...]) for layer in target.model.layers]
    packing = model_module.PackedMLP
    seen = []

    def packed_mlp(*args, **kwargs):
        gc.collect()
        seen.append([ref() is None for ref in loaded])
        return packing(*args, **kwargs)

    monkeypatch.setattr(model_module, "PackedMLP", packed_mlp)
    target.decode_model()
    assert seen == [[i < n for i in range(4)] for n in range(4)]  # layers before the n-th already freed


def test_packed_layout_replaces_the_projections_and_leaves_the_model_alone(pair):
    target, packed = pair
    assert all(isinstance(layer.self_attn, PackedAttentionProjections) for layer in packed.model.layers)
    assert all(isinstance(layer.mlp, PackedMLP) for layer in packed.model.layers)
    assert not any(isinstance(layer.self_attn, PackedAttentionProjections) for layer in target.model.layers)
    c = target.config
    width = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    assert packed.model.layers[0].self_attn.qkv_proj.weight.shape == (width, c.hidden_size)
    assert packed.model.layers[0].mlp.gate_up_proj.weight.shape == (2 * c.intermediate_size, c.hidden_size)
    again = packed.model.inference_layout()
    np.testing.assert_array_equal(
        np.asarray(again.layers[1].self_attn.qkv_proj.weight[...]),
        np.asarray(packed.model.layers[1].self_attn.qkv_proj.weight[...]),
    )


def test_packed_qkv_rotates_q_and_k_together_as_each_alone(pair):
    """One rotation of the packed q|k heads equals rotating q and k apart (run op by op, so the
    comparison is exact); v is not rotated."""
    _, packed = pair
    attn = packed.model.layers[0].self_attn
    c = packed.config
    x = jnp.asarray(np.random.default_rng(4).standard_normal((2, 3, c.hidden_size)), jnp.float32)
    cos_sin = packed.model._rope(jnp.asarray([[5, 6, 7], [0, 9, 2]], jnp.int32))
    q, k, v = attn.qkv(x, cos_sin)
    q0, k0, v0 = attn.qkv_proj.parts(x)
    np.testing.assert_array_equal(np.asarray(q), np.asarray(rotate(q0.reshape(2, 3, c.num_heads, -1), *cos_sin)))
    np.testing.assert_array_equal(np.asarray(k), np.asarray(rotate(k0.reshape(2, 3, c.num_kv_heads, -1), *cos_sin)))
    np.testing.assert_array_equal(np.asarray(v), np.asarray(v0.reshape(2, 3, c.num_kv_heads, -1)))


def test_packed_forward_logits_prefill_and_tree_block_match_unpacked(pair):
    target, packed = pair
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, target.config.vocab_size, size=(2, 12)).astype(np.int32)
    np.testing.assert_allclose(
        np.asarray(packed.forward_logits(tokens)), np.asarray(target.forward_logits(tokens)), atol=ATOL, rtol=0
    )
    lengths = np.asarray([12, 7], np.int32)
    (la, ca), (lb, cb) = prefill(target, tokens, lengths), prefill(packed, tokens, lengths)
    np.testing.assert_allclose(np.asarray(lb), np.asarray(la), atol=ATOL, rtol=0)
    assert_caches_close(ca, cb, lengths)

    # A verify-shaped block: 6 tree nodes under a random tree mask, at root position + depth.
    mask = random_tree_mask(rng, 2, 6)
    depth = mask.sum(-1) - 1
    tree_tokens = rng.integers(0, target.config.vocab_size, size=(2, 6)).astype(np.int32)
    positions = (lengths[:, None] + depth).astype(np.int32)
    (la, _, kva), (lb, _, kvb) = (
        block(target, tree_tokens, positions, mask, ca),
        block(packed, tree_tokens, positions, mask, cb),
    )
    np.testing.assert_allclose(np.asarray(lb), np.asarray(la), atol=ATOL, rtol=0)
    for x, y in zip(kva.k + kva.v, kvb.k + kvb.v):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=ATOL, rtol=0)


def test_one_token_block_matches_the_full_forward_and_row_zero_of_a_larger_block(pair):
    """T = 1 takes the decode path: it must equal the full causal forward at that position (mask
    True) and, with mask False (the token sees only the cache), row 0 of a 2-token block whose first
    query sees no block key (the general hybrid path)."""
    for target in pair:
        rng = np.random.default_rng(1)
        tokens = rng.integers(0, target.config.vocab_size, size=(2, 9)).astype(np.int32)
        lengths = np.asarray([8, 5], np.int32)
        _, cache = prefill(target, tokens, lengths)
        nxt = tokens[np.arange(2), lengths][:, None]
        logits, new_cache, _ = block(target, nxt, lengths[:, None], np.ones((2, 1, 1), bool), cache)
        full = np.asarray(target.forward_logits(tokens))
        for b, n in enumerate(lengths):
            np.testing.assert_allclose(np.asarray(logits[b, 0]), full[b, n], atol=ATOL, rtol=0)
        assert_caches_close(new_cache, prefill(target, tokens, lengths + 1)[1], lengths + 1)

        blind, _, _ = block(target, nxt, lengths[:, None], np.zeros((2, 1, 1), bool), cache)
        pair_mask = np.asarray([[False, False], [True, True]])[None].repeat(2, 0)
        two, _, _ = block(target, np.concatenate([nxt, nxt], 1), lengths[:, None] + np.arange(2), pair_mask, cache)
        np.testing.assert_allclose(np.asarray(blind[:, 0]), np.asarray(two[:, 0]), atol=ATOL, rtol=0)


def test_packed_greedy_generation_gives_the_same_tokens(pair):
    target, packed = pair
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, target.config.vocab_size, size=n).tolist() for n in (11, 4)]
    run = functools.partial(generate, max_new_tokens=12, eos_token_ids=(), attn_impl="xla")
    reference = run(target, prompts, mode="ar").tokens
    assert run(packed, prompts, mode="ar").tokens == reference
    assert run(packed, prompts, mode="pld").tokens == reference


@pytest.mark.parametrize("impl", ["xla", "pallas", "cudnn"])
def test_decode_attention_matches_float64_reference(impl):
    """Fresh random inputs; lengths include an empty sequence (o = 0) and a full cache. Off GPU,
    "cudnn" falls back to XLA with a warning; "pallas" runs the kernel in interpret mode."""
    rng = np.random.default_rng(7)
    b, hq, hkv, s, d = 3, 6, 2, 70, 64
    q = rng.standard_normal((b, 1, hq, d), np.float32)
    k = rng.standard_normal((b, s, hkv, d), np.float32)
    v = rng.standard_normal((b, s, hkv, d), np.float32)
    lengths = np.asarray([0, 33, s], np.int32)
    args = (jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(lengths))
    if impl == "cudnn":
        with pytest.warns(UserWarning, match="cuDNN"):
            o = attention.decode_attention(*args, impl=impl)
    else:
        o = attention.decode_attention(*args, impl=impl)
    ref, _ = attention_reference(q, k, v, cache_visibility(lengths, 1, s))
    assert o.shape == q.shape and o.dtype == q.dtype
    np.testing.assert_allclose(np.asarray(o), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_attend_and_write_block_matches_float64_reference(impl):
    """From the un-rotated q|k|v product: the rotated k and the v of the new token land at row
    lengths[b] (other rows untouched) and o is attention of the rotated q over rows [0, lengths[b])
    plus the new key where the token sees itself; an empty cache, a token that does not see
    itself, the cache's last row."""
    rng = np.random.default_rng(9)
    b, hq, hkv, s, d = 3, 6, 2, 70, 64
    qkv = rng.standard_normal((b, 1, hq + 2 * hkv, d), np.float32)
    k, v = (rng.standard_normal((b, s, hkv, d), np.float32) for _ in range(2))
    lengths = np.asarray([0, 33, s - 1], np.int32)
    self_mask = np.asarray([True, False, True])[:, None, None]
    angles = rng.uniform(0, 100, (b, 1, 1, d // 2))
    cos, sin = np.cos(angles), np.sin(angles)
    rope = (jnp.asarray(cos, jnp.float32), jnp.asarray(sin, jnp.float32))
    o, k_out, v_out = attention.attend_and_write_block(
        jnp.asarray(qkv.reshape(b, 1, -1)),
        rope,
        *(jnp.asarray(x) for x in (k, v, lengths, self_mask)),
        num_heads=hq,
        impl=impl,
    )
    x1, x2 = np.split(qkv[:, :, : hq + hkv].astype(np.float64), 2, axis=-1)
    qk = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    k_want, v_want = k.copy(), v.copy()
    k_want[np.arange(b), lengths] = qk[:, 0, hq:]
    v_want[np.arange(b), lengths] = qkv[:, 0, hq + hkv :]
    np.testing.assert_allclose(np.asarray(k_out), k_want, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(v_out), v_want)
    ref, _ = attention_reference(qk[:, :, :hq], k_want, v_want, cache_visibility(lengths + self_mask[:, 0, 0], 1, s))
    assert o.shape == (b, 1, hq, d) and o.dtype == np.float32
    np.testing.assert_allclose(np.asarray(o), ref, atol=2e-5, rtol=2e-5)


def test_decode_attention_refuses_a_block():
    q = jnp.zeros((1, 2, 4, 16))
    kv = jnp.zeros((1, 8, 2, 16))
    with pytest.raises(UserError, match="one query per sequence"):
        attention.decode_attention(q, kv, kv, jnp.asarray([3]))
    with pytest.raises(UserError, match="one token per sequence"):
        attention.attend_and_write_block(
            jnp.zeros((1, 2, 128)), (q, q), kv, kv, jnp.asarray([3]), jnp.ones((1, 2, 2), bool), num_heads=4
        )


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN and compiled Pallas need an NVIDIA GPU")
@pytest.mark.parametrize("impl", ["cudnn", "pallas"])
def test_gpu_bfloat16_decode_attention_matches_float64_reference(impl):
    """The compiled kernels in bf16 at a SmolLM2-like shape, lengths from empty to a full cache."""
    rng = np.random.default_rng(8)
    b, hq, hkv, s, d = 4, 9, 3, 4096, 64
    q, k, v = (
        jnp.asarray(rng.standard_normal(shape, np.float32), jnp.bfloat16)
        for shape in ((b, 1, hq, d), (b, s, hkv, d), (b, s, hkv, d))
    )
    lengths = np.asarray([0, 1, 2049, s], np.int32)
    o = np.asarray(attention.decode_attention(q, k, v, jnp.asarray(lengths), impl=impl), np.float32)
    as_f32 = [np.asarray(x, np.float32) for x in (q, k, v)]
    ref, _ = attention_reference(*as_f32, cache_visibility(lengths, 1, s))
    assert np.isfinite(o).all()
    assert np.abs(o - ref).max() < 2e-2 * np.abs(ref).max()
