"""The draft block: its attentions against float64 references, inference through the ring buffer
against the training forward (with wrap-around), the exact sliding window, tree slots, memory."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from longspec_jax.attention import sliding_window_attention
from longspec_jax.draft import (
    DraftBlock,
    DraftConfig,
    draft_commit,
    draft_hidden,
    draft_prefill,
    draft_propose_level,
    flash_noisy_cross_attention,
    init_draft_state,
    lagged_cross_attention,
)
from longspec_jax.target import random_target
from tests.tiny_models import tiny_config

WINDOW = 8
SIZES = [1, 3, 5, 3, 1, 5, 3, 1, 5, 3]  # step block sizes: 30 tokens, few distinct shapes to compile
CFG = tiny_config()
HKV, D, V = CFG.num_kv_heads, CFG.head_dim, CFG.vocab_size
KERNEL_HEAD_DIM = 64  # the smallest head dim the Pallas kernels take


def _randomized(module, seed, std):
    """Redraw every parameter (vectors around 1, matrices N(0, std)) so that logits are O(1) and
    any wrong term shows up (the default init gives logits ~0.05)."""
    graphdef, state = nnx.split(module)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    redrawn = [
        (1.0 if x.ndim == 1 else 0.0) + (0.1 if x.ndim == 1 else std) * jax.random.normal(k, x.shape, x.dtype)
        for k, x in zip(keys, leaves)
    ]
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, redrawn))


@functools.cache
def _models(window=WINDOW, head_dim=D):
    config = tiny_config(head_dim=head_dim)
    target = _randomized(random_target(config, seed=1).model, 11, 0.3)
    block = _randomized(DraftBlock(config, DraftConfig(window=window), rngs=nnx.Rngs(0)), 12, 0.15)
    return block, target


# The block as training runs it, and in its inference layout (packed, [out, in]; with the products
# of 1-3 rows as multiply-reduce, as on a GPU): every inference path must give the training forward.
LAYOUTS = {"training": None, "packed": (), "packed, small rows as reductions": (1, 2, 3)}


def _inference_block(block, layout):
    rows = LAYOUTS[layout]
    return block if rows is None else block.inference_layout(rows)


def _inputs(b, l, seed=0, head_dim=D):
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, V, (b, l)), jnp.int32)
    target_k = jnp.asarray(rng.normal(size=(b, l, HKV, head_dim)), jnp.float32)
    target_v = jnp.asarray(rng.normal(size=(b, l, HKV, head_dim)), jnp.float32)
    return tokens, target_k, target_v


@nnx.jit
def _train_logits_jit(block, target, tokens, positions, target_k, target_v, lag):
    return target.lm_logits(draft_hidden(block, target, tokens, positions, target_k, target_v, lag))


def _train_logits(block, target, tokens, positions, target_k, target_v, lag):
    return np.asarray(_train_logits_jit(block, target, tokens, positions, target_k, target_v, jnp.int32(lag)))


# Jitted as the engine will run it; one compile per block shape keeps the tests fast.
def _commit_logits(block, target, *args, attn_impl=None):
    """draft_commit with the LM head's logits of its features (what these tests compare)."""
    features, state = draft_commit(block, target, *args, attn_impl=attn_impl)
    return target.lm_logits(features), state


def _propose_level_logits(block, target, state, tokens, depth, *args, attn_impl=None):
    features, state = draft_propose_level(block, target, state, tokens, depth, *args, attn_impl=attn_impl)
    return target.lm_logits(features), state


_commit = nnx.jit(_commit_logits, static_argnames=("attn_impl",))
_propose_level = nnx.jit(_propose_level_logits, static_argnames=("depth", "attn_impl"))
_prefill = nnx.jit(draft_prefill)


def _dense_attention64(q, k, v, mask):
    """float64 numpy reference: q [B,T,Hq,D], k/v [B,S,Hkv,D], mask [B,T,S]; fully masked rows -> 0."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    s = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1])
    s = np.where(mask[:, None], s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True)
    p = np.where(mask[:, None], np.exp(s - np.where(np.isfinite(m), m, 0)), 0)
    p = p / np.maximum(p.sum(-1, keepdims=True), 1e-300)
    return np.einsum("bhts,bshd->bthd", p, v)


def _qkv(b, l, seed):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, l, CFG.num_heads, D)).astype(np.float32)
    k = rng.normal(size=(b, l, HKV, D)).astype(np.float32)
    v = rng.normal(size=(b, l, HKV, D)).astype(np.float32)
    return q, k, v


def test_flash_noisy_cross_attention_matches_lagged_dense_reference():
    q, k, v = _qkv(2, 13, 0)
    attend = jax.jit(flash_noisy_cross_attention)  # lag traced: one program for every j
    t = np.arange(13)
    for lag in range(1, 5):
        mask = np.broadcast_to(t[None, :, None] - t[None, None, :] >= lag, (2, 13, 13))
        got = np.asarray(attend(q, k, v, jnp.int32(lag)))
        np.testing.assert_allclose(got, _dense_attention64(q, k, v, mask), atol=2e-5)
        assert np.all(got[:, :lag] == 0)


def test_lagged_cross_attention_matches_per_query_prefix_reference():
    """Query i sees target rows [0, cross_len[b, i]): a spread of up to T rows, a prefix running
    into the cache end (the T-row block is then clamped), and a padding query that is ignored."""
    b, t, s = 3, 4, 20
    rng = np.random.default_rng(2)
    q = rng.normal(size=(b, t, CFG.num_heads, D)).astype(np.float32)
    k, v = (rng.normal(size=(b, s, HKV, D)).astype(np.float32) for _ in range(2))
    cross_len = np.array([[7, 8, 9, 11], [3, 3, 3, 3], [18, 19, 20, 20]], np.int32)
    valid = np.array([[True] * 4, [True, True, True, False], [True] * 4])
    cross_len[1, 3] = 15  # padding: far from the others, must not disturb them
    got = np.asarray(jax.jit(lagged_cross_attention)(q, k, v, cross_len, valid))
    want = _dense_attention64(q, k, v, np.arange(s)[None, None, :] < cross_len[:, :, None])
    np.testing.assert_allclose(got[valid], want[valid], atol=2e-5)


@pytest.mark.parametrize("length", [5, 21, 24])
def test_sliding_window_attention_matches_band_reference(length):
    q, k, v = _qkv(2, length, 1)
    t = np.arange(length)
    diff = t[:, None] - t[None, :]
    mask = np.broadcast_to((diff >= 0) & (diff <= WINDOW), (2, length, length))
    want = _dense_attention64(q, k, v, mask)
    got = np.asarray(sliding_window_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), WINDOW, impl="xla"))
    np.testing.assert_allclose(got, want, atol=2e-5)
    # The GPU path's window semantics (cuDNN gets the same call), run here through XLA.
    local = jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=(WINDOW, 0), implementation="xla")
    np.testing.assert_allclose(np.asarray(local), want, atol=2e-5)


def _run_steps(block, target, state, tokens, positions, target_k, target_v, start, sizes, attn_impl=None):
    """Commit tokens[:, start:] block by block, as the LongSpec proposer does."""
    b = tokens.shape[0]
    out, t0 = [], start
    for t in sizes:
        logits, state = _commit(
            block,
            target,
            state,
            tokens[:, t0 : t0 + t],
            positions[:, t0 : t0 + t],
            jnp.ones((b, t), bool),
            target_k,
            target_v,
            attn_impl=attn_impl,
        )
        out.append(np.asarray(logits))
        t0 += t
    return np.concatenate(out, axis=1), state


@pytest.mark.parametrize(
    "layout,attn_impl", [(layout, "xla") for layout in LAYOUTS] + [("packed, small rows as reductions", "pallas")]
)
def test_ring_buffer_commits_match_training_forward(layout, attn_impl):
    """Blocks of 1, 3, 5 tokens through a ring of W = 8 slots, wrapping around 4 times, against the
    full-sequence training forward with lag 1 (a commit's cross-attention). Impl "pallas": the
    cross-attention over the target's cache as the GPU's kernel runs it (interpret mode), at a head
    dim it takes."""
    head_dim = KERNEL_HEAD_DIM if attn_impl == "pallas" else D
    trained, target = _models(head_dim=head_dim)
    block = _inference_block(trained, layout)
    b, l = 2, sum(SIZES)
    tokens, target_k, target_v = _inputs(b, l, head_dim=head_dim)
    positions = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, l))
    want = _train_logits(trained, target, tokens, positions, target_k, target_v, 1)
    state = init_draft_state(block, b, tree_slots=4)
    got, state = _run_steps(block, target, state, tokens, positions, target_k, target_v, 0, SIZES, attn_impl)
    assert np.abs(want).max() > 1.0
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    np.testing.assert_array_equal(
        np.sort(np.asarray(state.positions[:, :WINDOW]), axis=1), np.asarray(positions[:, l - WINDOW :])
    )


@pytest.mark.parametrize("layout", LAYOUTS)
def test_prefill_then_steps_match_training_forward(layout):
    """Prompts of different lengths (one shorter than the window) prefilled into the ring, then
    decoded one and several tokens at a time."""
    trained, target = _models()
    block = _inference_block(trained, layout)
    b, l = 2, 30
    tokens, target_k, target_v = _inputs(b, l, seed=3)
    positions = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, l))
    want = _train_logits(trained, target, tokens, positions, target_k, target_v, 1)
    lengths = jnp.asarray([13, 5], jnp.int32)
    state = _prefill(block, target, init_draft_state(block, b, tree_slots=4), tokens, lengths)
    t0 = np.asarray(lengths)
    for t in [1, 3, 1, 5, 3]:
        idx = jnp.asarray(t0[:, None] + np.arange(t)[None, :], jnp.int32)
        logits, state = _commit(
            block,
            target,
            state,
            jnp.take_along_axis(tokens, idx, axis=1),
            idx,
            jnp.ones((b, t), bool),
            target_k,
            target_v,
        )
        for r in range(b):
            np.testing.assert_allclose(np.asarray(logits[r]), want[r, t0[r] : t0[r] + t], atol=1e-4, rtol=1e-4)
        t0 = t0 + t


def test_sliding_window_is_exact_in_training_and_inference():
    """Changing token k changes the logits at i = k + W (key i - W is in the window) and at no
    i > k + W (never sees i - W - 1), in the training forward and through the ring."""
    block, target = _models()
    b, l, k = 2, sum(SIZES), 6
    tokens, target_k, target_v = _inputs(b, l, seed=4)
    changed = tokens.at[:, k].set((tokens[:, k] + 1) % V)
    positions = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, l))
    for run in (
        lambda toks: _train_logits(block, target, toks, positions, target_k, target_v, 1),
        lambda toks: _run_steps(
            block, target, init_draft_state(block, b, tree_slots=4), toks, positions, target_k, target_v, 0, SIZES
        )[0],
    ):
        base, other = run(tokens), run(changed)
        assert np.abs(base[:, k + WINDOW] - other[:, k + WINDOW]).max() > 1e-3
        np.testing.assert_allclose(base[:, k + WINDOW + 1 :], other[:, k + WINDOW + 1 :], atol=1e-6)


@pytest.mark.parametrize("attn_impl", ["xla", "pallas"])
def test_tree_levels_through_tree_slots_match_ancestor_chains(attn_impl):
    """A tree of widths (2, 3) after a prefix: level 1 fed as the tree's level, level 2 (3 nodes,
    ancestors in their tree slots) == each node committed as the chain [parent, node] in one
    block; nothing enters the ring. Impl "pallas" as the GPU runs it (interpret mode), against
    chains committed through XLA, at a head dim the kernels take."""
    head_dim = KERNEL_HEAD_DIM if attn_impl == "pallas" else D
    block, target = _models(head_dim=head_dim)
    b, prefix = 2, 11
    tokens, target_k, target_v = _inputs(b, prefix + 2, seed=5, head_dim=head_dim)
    fresh = init_draft_state(block, b, tree_slots=6)
    state0 = _prefill(block, target, fresh, tokens[:, :prefix], jnp.full((b,), prefix, jnp.int32))
    rng = np.random.default_rng(6)
    level1 = jnp.asarray(rng.integers(0, V, (b, 2)), jnp.int32)
    level2 = jnp.asarray(rng.integers(0, V, (b, 3)), jnp.int32)
    parents = np.array([1, 0, 1])  # level-2 node i hangs under level-1 node parents[i]
    root = prefix - 1
    root_positions = jnp.full((b,), root, jnp.int32)
    # Flat nodes: 0 the root, 1-2 level 1, 3-5 level 2; sees[i, j]: node j is node i or an ancestor.
    sees = np.zeros((6, 6), bool)
    sees[:, 0] = True
    sees[np.arange(6), np.arange(6)] = True
    sees[3 + np.arange(3), 1 + parents] = True
    sees = jnp.broadcast_to(jnp.asarray(sees), (b, 6, 6))

    def level(state, toks, depth, rows):
        return _propose_level(
            block,
            target,
            state,
            toks,
            depth,
            sees[:, rows, : rows.stop],
            root_positions,
            target_k,
            target_v,
            attn_impl=attn_impl,
        )

    logits1, state1 = level(state0, level1, 1, slice(1, 3))
    logits2, state2 = level(state1, level2, 2, slice(3, 6))
    np.testing.assert_array_equal(np.asarray(state2.positions[:, :WINDOW]), np.asarray(state0.positions[:, :WINDOW]))

    # The chain [parent, node] after the root at positions root + 1, root + 2, every query seeing
    # the target prefix [0, root): the lag of a commit at position root + 1.
    for i, p in enumerate(parents):
        chain = jnp.stack([level1[:, p], level2[:, i]], axis=1)
        chain_positions = jnp.broadcast_to(jnp.asarray([root + 1, root + 2], jnp.int32), (b, 2))
        want, _ = _commit(
            block,
            target,
            state0,
            chain,
            chain_positions,
            jnp.ones((b, 2), bool),
            target_k[:, :root],
            target_v[:, :root],
        )
        np.testing.assert_allclose(np.asarray(logits1[:, p]), np.asarray(want[:, 0]), atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(logits2[:, i]), np.asarray(want[:, 1]), atol=1e-5, rtol=1e-5)
    assert np.abs(np.asarray(logits2[:, 0] - logits2[:, 1])).max() > 1e-3


def test_padding_rows_are_neither_seen_nor_committed():
    """A block [a, pad, c] at positions [9, 10, 11] gives c the logits of the block [a, c] at
    [9, 11]; only a and c enter the ring."""
    block, target = _models()
    b = 2
    tokens, target_k, target_v = _inputs(b, 12, seed=7)
    state = _prefill(block, target, init_draft_state(block, b, tree_slots=4), tokens, jnp.asarray([9, 9]))
    positions = jnp.broadcast_to(jnp.arange(9, 12, dtype=jnp.int32), (b, 3))
    valid = jnp.asarray([[True, False, True]] * b)
    padded, padded_state = _commit(block, target, state, tokens[:, 9:12], positions, valid, target_k, target_v)
    kept = jnp.asarray([0, 2])
    want, _ = _commit(
        block, target, state, tokens[:, 9:12][:, kept], positions[:, kept], jnp.ones((b, 2), bool), target_k, target_v
    )
    np.testing.assert_allclose(np.asarray(padded[:, kept]), np.asarray(want), atol=1e-5)
    assert set(np.asarray(padded_state.positions[0, :WINDOW]).tolist()) == {2, 4, 5, 6, 7, 8, 9, 11}


def test_draft_state_bytes_do_not_grow_with_context():
    """W = 512 default: the state after prefilling a 1k and a 100k prompt, and after a step against
    1k and 100k target caches, has the same bytes (shapes only: nothing is allocated)."""
    block = DraftBlock(CFG, rngs=nnx.Rngs(0))
    target = random_target(CFG).model
    assert block.window == 512

    def state_after(context):
        state = init_draft_state(block, 1)
        state = draft_prefill(block, target, state, jnp.zeros((1, context), jnp.int32), jnp.asarray([context]))
        cache = jnp.zeros((1, context, HKV, D))
        _, state = draft_commit(
            block,
            target,
            state,
            jnp.zeros((1, 4), jnp.int32),
            jnp.arange(4, dtype=jnp.int32)[None],
            jnp.ones((1, 4), bool),
            cache,
            cache,
        )
        return state

    small = jax.eval_shape(lambda: state_after(1024))
    large = jax.eval_shape(lambda: state_after(100_000))
    assert small.nbytes == large.nbytes == (2 * (512 + 128) * HKV * D * 4 + (512 + 128) * 4)


def test_inference_layout_packs_once_and_keeps_the_training_block():
    block, _ = _models()
    packed = block.inference_layout((2, 3))
    twice = packed.inference_layout((2, 3))
    assert not hasattr(block.self_attn, "qkv_proj") and hasattr(packed.self_attn, "qkv_proj")
    n_params = lambda m: sum(x.size for x in jax.tree.leaves(nnx.state(m, nnx.Param)))
    assert n_params(packed) == n_params(block) == n_params(twice)
    assert jax.tree.structure(nnx.state(twice)) == jax.tree.structure(nnx.state(packed))


def test_proposers_of_one_draft_share_its_packed_block():
    """Every proposer made from a draft (mode auto makes one per plan) uses one packed copy of its
    block; replacing the block's arrays packs them again."""
    from longspec_jax.draft_io import init_draft
    from longspec_jax.proposers import proposer_for

    target = random_target(tiny_config(), seed=0, dtype="float32")
    draft = init_draft(target, seed=1)
    leaves = lambda params: jax.tree.leaves(params.block)
    first = leaves(proposer_for("longspec", target, draft, (2, 2))[1])
    second = leaves(proposer_for("longspec", target, draft, (4, 1), lookup_tokens=3)[1])
    assert len(first) == len(second) and all(a is b for a, b in zip(first, second))
    graphdef, state = nnx.split(draft.block)
    nnx.update(draft.block, jax.tree.map(lambda x: x * 2, state))
    third = leaves(proposer_for("longspec", target, draft, (2, 2))[1])
    assert not any(a is b for a, b in zip(first, third))
    np.testing.assert_allclose(np.asarray(third[0]), 2 * np.asarray(first[0]), rtol=1e-6)
    cut = draft.with_candidate_tokens(np.arange(0, 64, 2))  # the head's rows of its candidates, gathered once
    heads = [proposer_for("longspec", target, cut, w)[1].head for w in ((2, 2), (4, 1))]
    assert heads[0].rows is heads[1].rows and heads[0].rows.shape == (
        32,
        target.config.hidden_size,
    )
