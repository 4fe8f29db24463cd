"""The static KV cache: prefill, block forwards and commit against the plain full forward."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from longspec_jax import UserError, init_cache, random_target
from longspec_jax import commit as _commit_eager
from longspec_jax.model import BlockKV, KVCache, Transformer
from longspec_jax.model_shapes import MODEL_SHAPES
from tests.tiny_models import tiny_config

ATOL = 2e-5
MAX_LEN = 32


commit = jax.jit(_commit_eager)


@pytest.fixture(scope="module")
def target():
    return random_target(tiny_config(), seed=1, dtype="float32")


# Jitted entry points with the parameters as arguments, as the generation loop runs them.
@functools.partial(jax.jit, static_argnums=0)
def _prefill(graphdef, params, tokens, lengths, cache):
    return nnx.merge(graphdef, params).prefill(tokens, lengths, cache, attn_impl="xla")


@functools.partial(jax.jit, static_argnums=0)
def _block(graphdef, params, tokens, positions, mask, cache):
    return nnx.merge(graphdef, params).forward_block(tokens, positions, mask, cache, attn_impl="xla")


def prefill(target, tokens, lengths):
    tokens = jnp.asarray(tokens, jnp.int32)
    cache = init_cache(target.config, tokens.shape[0], MAX_LEN, jnp.float32)
    return _prefill(*nnx.split(target.model), tokens, jnp.asarray(lengths, jnp.int32), cache)


def block(target, tokens, positions, mask, cache):
    return _block(
        *nnx.split(target.model),
        jnp.asarray(tokens, jnp.int32),
        jnp.asarray(positions, jnp.int32),
        jnp.asarray(mask, bool),
        cache,
    )


def decode_one(target, token_per_seq, cache):
    """One AR step: a T=1 block at position `lengths`, then commit it."""
    b = len(token_per_seq)
    logits, cache, kv = block(
        target, np.asarray(token_per_seq)[:, None], cache.lengths[:, None], np.ones((b, 1, 1), bool), cache
    )
    return logits[:, 0], commit(cache, kv, jnp.zeros((b, 1), jnp.int32), jnp.ones((b,), jnp.int32))


def _random_tokens(seed, shape, vocab=128):
    return np.random.default_rng(seed).integers(0, vocab, size=shape, dtype=np.int32)


def test_init_cache_shapes():
    config = tiny_config()
    cache = init_cache(config, 3, 20, jnp.bfloat16)
    assert len(cache.k) == len(cache.v) == config.num_layers
    assert cache.k[0].shape == (3, 20, config.num_kv_heads, config.head_dim) and cache.k[0].dtype == jnp.bfloat16
    assert cache.lengths.dtype == jnp.int32 and cache.lengths.tolist() == [0, 0, 0]


def test_cached_decode_matches_full_forward(target):
    seq = _random_tokens(0, (1, 12))
    full = np.asarray(target.forward_logits(seq))
    prompt_len = 5
    last, cache = prefill(target, seq[:, :prompt_len], [prompt_len])
    np.testing.assert_allclose(last, full[:, prompt_len - 1], atol=ATOL)
    for t in range(prompt_len, seq.shape[1]):
        logits, cache = decode_one(target, seq[:, t], cache)
        np.testing.assert_allclose(logits, full[:, t], atol=ATOL)
        assert cache.lengths.tolist() == [t + 1]


def test_block_with_causal_mask_equals_single_steps(target):
    seq = _random_tokens(1, (2, 11))
    prompt_len, t_block = 6, 5
    _, start = prefill(target, seq[:, :prompt_len], [prompt_len] * 2)
    positions = np.broadcast_to(np.arange(prompt_len, prompt_len + t_block), (2, t_block))
    causal = np.broadcast_to(np.tril(np.ones((t_block, t_block), bool)), (2, t_block, t_block))
    block_logits, block_cache, kv = block(target, seq[:, prompt_len:], positions, causal, start)
    assert block_cache.lengths.tolist() == [prompt_len] * 2  # forward_block commits nothing
    block_cache = commit(
        block_cache, kv, jnp.broadcast_to(jnp.arange(t_block), (2, t_block)), jnp.full((2,), t_block, jnp.int32)
    )
    step_cache = start
    for i in range(t_block):
        logits, step_cache = decode_one(target, seq[:, prompt_len + i], step_cache)
        np.testing.assert_allclose(block_logits[:, i], logits, atol=ATOL)
    end = prompt_len + t_block
    assert block_cache.lengths.tolist() == step_cache.lengths.tolist() == [end] * 2
    for a, b in zip(block_cache.k + block_cache.v, step_cache.k + step_cache.v):
        np.testing.assert_allclose(a[:, :end], b[:, :end], atol=ATOL)


def test_commit_writes_the_accepted_path_of_a_scrambled_tree(target):
    """Block nodes in scrambled order; sequence 0 accepts the path a -> b -> c, sequence 1 the path
    a -> x, which skips the block's nodes between them. path lists each accepted path's block
    indices in path order, padded to A = 4 with other nodes (rows past the new length may hold
    anything). After commit, each cache must equal a fresh prefill of prompt + accepted tokens, and
    the prompt rows must be the very same values as before."""
    prompt_lens = [4, 7]
    prompt = _random_tokens(2, (2, 7))
    node_tokens = _random_tokens(3, (2, 5))
    # Block order per sequence (index -> node).
    orders = [["c", "x", "a", "b", "y"], ["b", "a", "y", "c", "x"]]
    accepted = [["a", "b", "c", "y"], ["a", "x", "c", "b"]]
    n_accept = [3, 2]
    depth = {"a": 0, "b": 1, "c": 2, "x": 1, "y": 2}
    ancestors = {"a": "a", "b": "ab", "c": "abc", "x": "ax", "y": "axy"}
    t_block = 5
    tokens = np.zeros((2, t_block), np.int32)
    positions = np.zeros((2, t_block), np.int32)
    mask = np.zeros((2, t_block, t_block), bool)
    path = np.zeros((2, 4), np.int32)
    for s, order in enumerate(orders):
        node_token = dict(zip("abcxy", node_tokens[s]))
        for i, node in enumerate(order):
            tokens[s, i] = node_token[node]
            positions[s, i] = prompt_lens[s] + depth[node]
            mask[s, i] = [other in ancestors[node] for other in order]
        path[s] = [order.index(n) for n in accepted[s]]
    _, before = prefill(target, prompt, prompt_lens)
    _, verified, kv = block(target, tokens, positions, mask, before)
    cache = commit(verified, kv, jnp.asarray(path), jnp.asarray(n_accept, jnp.int32))
    assert cache.lengths.tolist() == [n + a for n, a in zip(prompt_lens, n_accept)]
    for s, (n, a) in enumerate(zip(prompt_lens, n_accept)):
        kept = [dict(zip("abcxy", node_tokens[s]))[node] for node in accepted[s][:a]]
        _, fresh = prefill(target, np.concatenate([prompt[s, :n], kept])[None], [n + a])
        for ours, ref, old in zip(cache.k + cache.v, fresh.k + fresh.v, before.k + before.v):
            np.testing.assert_array_equal(ours[s, :n], old[s, :n])
            np.testing.assert_allclose(ours[s, : n + a], ref[0, : n + a], atol=ATOL)


def test_commit_moves_exactly_the_path_rows():
    """commit against plain indexing on random arrays (batch 2, different lengths and n_accept, a
    path that skips and repeats block rows): rows lengths + i get block row path[i] for all i < A,
    and every other cache row keeps its value exactly."""
    rng = np.random.default_rng(11)
    b, s, t, h, d, layers = 2, 12, 5, 2, 3, 2
    lengths = np.asarray([3, 6], np.int32)
    path = np.asarray([[0, 2, 4, 1], [0, 3, 3, 0]], np.int32)
    n_accept = np.asarray([3, 1], np.int32)
    k, v = ([rng.standard_normal((b, s, h, d), np.float32) for _ in range(layers)] for _ in range(2))
    bk, bv = ([rng.standard_normal((b, t, h, d), np.float32) for _ in range(layers)] for _ in range(2))
    as_jax = lambda arrays: tuple(map(jnp.asarray, arrays))  # noqa: E731
    cache = KVCache(k=as_jax(k), v=as_jax(v), lengths=jnp.asarray(lengths))
    out = commit(cache, BlockKV(k=as_jax(bk), v=as_jax(bv)), path, n_accept)
    assert out.lengths.tolist() == (lengths + n_accept).tolist()
    for got, old, new in zip(out.k + out.v, k + v, bk + bv):
        want = old.copy()
        for row in range(b):
            want[row, lengths[row] : lengths[row] + path.shape[1]] = new[row, path[row]]
        np.testing.assert_array_equal(np.asarray(got), want)


def test_a_tree_block_leaves_the_cache_and_a_one_token_block_writes_its_row(target):
    """T > 1 returns the block's K/V and the cache arrays unchanged; T = 1 writes its row at lengths
    (and nothing else), the K/V it also returns."""
    prompt = _random_tokens(12, (2, 7))
    lengths = np.asarray([4, 7], np.int32)
    _, cache = prefill(target, prompt, lengths)
    mask = np.broadcast_to(np.tril(np.ones((3, 3), bool)), (2, 3, 3))
    _, after, kv = block(target, _random_tokens(13, (2, 3)), lengths[:, None] + np.arange(3), mask, cache)
    assert after.lengths.tolist() == lengths.tolist()
    for got, old in zip(after.k + after.v, cache.k + cache.v):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(old))
    assert kv.k[0].shape == (2, 3, target.config.num_kv_heads, target.config.head_dim)

    _, after, kv = block(target, _random_tokens(14, (2, 1)), lengths[:, None], np.ones((2, 1, 1), bool), cache)
    assert after.lengths.tolist() == lengths.tolist()
    for got, old, new in zip(after.k + after.v, cache.k + cache.v, kv.k + kv.v):
        want = np.asarray(old).copy()
        want[np.arange(2), lengths] = np.asarray(new)[:, 0]
        np.testing.assert_array_equal(np.asarray(got), want)


def test_batch_of_different_lengths_equals_each_alone(target):
    lengths = [5, 9]
    padded = _random_tokens(5, (2, 9))
    padded[0, 5:] = 0  # padding value must not matter
    steps = _random_tokens(6, (3, 2))
    batch_last, batch_cache = prefill(target, padded, lengths)
    batch_logits = [batch_last]
    for token_pair in steps:
        logits, batch_cache = decode_one(target, token_pair, batch_cache)
        batch_logits.append(logits)
    for s, n in enumerate(lengths):
        last, cache = prefill(target, padded[s : s + 1, :n], [n])
        alone = [last]
        for token_pair in steps:
            logits, cache = decode_one(target, token_pair[s : s + 1], cache)
            alone.append(logits)
        for b, a in zip(batch_logits, alone):
            np.testing.assert_allclose(b[s], a[0], atol=ATOL)


def test_prefill_logits_are_the_last_prompt_position(target):
    tokens = _random_tokens(7, (2, 8))
    last, _ = prefill(target, tokens, [3, 8])
    full = np.asarray(target.forward_logits(tokens))
    np.testing.assert_allclose(last[0], full[0, 2], atol=ATOL)
    np.testing.assert_allclose(last[1], full[1, 7], atol=ATOL)


def test_last_layer_kv_equals_last_layer_cache(target):
    tokens = _random_tokens(8, (2, 7))
    positions = np.broadcast_to(np.arange(7, dtype=np.int32), (2, 7))
    k, v = target.model.last_layer_kv(jnp.asarray(tokens), jnp.asarray(positions), attn_impl="xla")
    _, cache = prefill(target, tokens, [7, 7])
    assert k.shape == (2, 7, target.config.num_kv_heads, target.config.head_dim)
    np.testing.assert_allclose(k, cache.k[-1][:, :7], atol=ATOL)
    np.testing.assert_allclose(v, cache.v[-1][:, :7], atol=ATOL)


def test_last_layer_kv_with_features_gives_the_targets_own_logits(target):
    tokens = jnp.asarray(_random_tokens(10, (2, 7)))
    positions = jnp.broadcast_to(jnp.arange(7, dtype=jnp.int32), (2, 7))
    k, v = target.model.last_layer_kv(tokens, positions, attn_impl="xla")
    k2, v2, features = target.model.last_layer_kv(tokens, positions, attn_impl="xla", with_features=True)
    np.testing.assert_allclose(k2, k, atol=ATOL)
    np.testing.assert_allclose(v2, v, atol=ATOL)
    logits = target.model.lm_logits(features)
    np.testing.assert_allclose(logits, target.model.forward_logits(tokens, attn_impl="xla"), atol=ATOL)


def test_last_layer_kv_keys_rotate_with_positions(target):
    """Anchor-offset positions: equal to a block forward at those positions after the same prefix."""
    tokens = _random_tokens(9, (1, 6))
    positions = np.array([[0, 1, 2, 3, 20, 21]], np.int32)
    k, v = target.model.last_layer_kv(jnp.asarray(tokens), jnp.asarray(positions), attn_impl="xla")
    cache = init_cache(target.config, 1, MAX_LEN, jnp.float32)
    causal = np.tril(np.ones((6, 6), bool))[None]
    _, _, kv = block(target, tokens, positions, causal, cache)
    np.testing.assert_allclose(k, kv.k[-1], atol=ATOL)
    np.testing.assert_allclose(v, kv.v[-1], atol=ATOL)


def test_tied_and_bfloat16_random_targets():
    config = tiny_config(tie_word_embeddings=True)
    target = random_target(config, seed=3, dtype="bfloat16")
    assert target.model.lm_head is None
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(nnx.state(target.model, nnx.Param)))
    tokens = _random_tokens(10, (1, 6))
    logits = target.forward_logits(tokens)
    assert logits.dtype == jnp.float32 and logits.shape == (1, 6, config.vocab_size)
    hidden = target.model.embed_tokens(jnp.asarray(tokens))
    manual = jnp.einsum("bth,vh->btv", hidden.astype(jnp.float32), target.model.embed[...].astype(jnp.float32))
    np.testing.assert_allclose(target.model.lm_logits(hidden), manual, rtol=1e-2, atol=1e-3)


def test_prefill_longer_than_cache_is_a_user_error(target):
    cache = init_cache(target.config, 1, 4, jnp.float32)
    with pytest.raises(UserError, match="does not fit a KV cache of 4 rows"):
        target.model.prefill(jnp.zeros((1, 5), jnp.int32), jnp.array([5]), cache, attn_impl="xla")


@pytest.mark.parametrize(
    "config, expected",
    [  # published parameter counts of Llama-2-7B (Vicuna-7B's shape), Llama-3.1-8B, QwQ-32B, SmolLM2-135M, Qwen2.5-7B
        (MODEL_SHAPES["vicuna7b"], 6_738_415_616),
        (MODEL_SHAPES["llama31_8b"], 8_030_261_248),
        (MODEL_SHAPES["qwq32b"], 32_763_876_352),
        (MODEL_SHAPES["smollm2_135m"], 134_515_008),
        (
            tiny_config(
                model_type="qwen2",
                vocab_size=152064,
                hidden_size=3584,
                intermediate_size=18944,
                num_layers=28,
                num_heads=28,
                num_kv_heads=4,
                head_dim=128,
                qkv_bias=True,
            ),
            7_615_616_512,
        ),
    ],
)
def test_full_size_parameter_counts(config, expected):
    # eval_shape: shapes only, nothing materialised.
    model = nnx.eval_shape(lambda: Transformer(config, dtype="bfloat16", rngs=nnx.Rngs(0)))
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert sum(p.size for p in params) == expected
    assert {p.dtype for p in params} == {jnp.dtype("bfloat16")}
