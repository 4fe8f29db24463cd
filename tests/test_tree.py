import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longspec_jax.acceptance import accept
from longspec_jax.errors import UserError
from longspec_jax.tree import (
    DEFAULT_WIDTHS,
    chain_tree,
    expand_level,
    init_tree,
    level_block,
    level_slice,
    lookup_widths,
    node_depths,
    num_nodes,
    validate_widths,
    vocab_top_k,
    with_lookup_chain,
)


def random_log_probs(rng, shape):
    logits = rng.normal(size=shape) * 2.0
    return logits - np.log(np.exp(logits).sum(-1, keepdims=True))


def build(widths, root_tokens, level_log_probs, root_positions):
    """The per-level protocol the speculative loop follows; also returns each level's block."""
    tree = init_tree(root_tokens, level_log_probs[0], widths)
    blocks = []
    for depth in range(1, len(widths)):
        blocks.append(level_block(tree, depth, root_positions))
        tree = expand_level(tree, depth, level_log_probs[depth])
    return tree, blocks


def brute_force_beam(widths, root_lp, level_lps):
    """numpy: per level, all (node, token) pairs ranked by cumulative log-prob, top W[d] kept."""
    tokens, parents, scores = [None], [-1], [0.0]
    frontier = [0]
    lps = [root_lp[None]] + list(level_lps)
    for d, w in enumerate(widths):
        cands = [
            (scores[node] + lps[d][i, t], node, t) for i, node in enumerate(frontier) for t in range(lps[d].shape[-1])
        ]
        cands.sort(key=lambda c: -c[0])
        frontier = []
        for score, node, t in cands[:w]:
            frontier.append(len(tokens))
            tokens.append(t)
            parents.append(node)
            scores.append(score)
    return np.array(tokens[1:]), np.array(parents), np.array(scores)


@pytest.mark.parametrize("widths,vocab", [((3, 5, 4), 7), ((2, 5, 6), 3), ((4,), 9)])
def test_beam_levels_match_brute_force(widths, vocab):
    rng = np.random.default_rng(0)
    batch = 2
    n = num_nodes(widths)
    level_lps = [random_log_probs(rng, (batch, vocab))] + [
        random_log_probs(rng, (batch, w, vocab)) for w in widths[:-1]
    ]
    root_tokens = jnp.array([5, 1]) % vocab
    root_positions = jnp.array([11, 3])
    tree, blocks = jax.jit(build, static_argnums=0)(
        widths, root_tokens, [jnp.asarray(x, jnp.float32) for x in level_lps], root_positions
    )

    depths = node_depths(widths)
    for b in range(batch):
        tokens, parents, scores = brute_force_beam(widths, level_lps[0][b], [lp[b] for lp in level_lps[1:]])
        np.testing.assert_array_equal(np.asarray(tree.tokens[b, 1:]), tokens)
        np.testing.assert_array_equal(np.asarray(tree.parents[b]), parents)
        np.testing.assert_allclose(np.asarray(tree.scores[b]), scores, rtol=1e-5, atol=1e-5)
        assert int(tree.tokens[b, 0]) == int(root_tokens[b])

        # Mask rows are exactly the ancestor sets (self included).
        for i in range(n):
            ancestors, j = set(), i
            while j >= 0:
                ancestors.add(j)
                j = parents[j]
            assert set(np.flatnonzero(np.asarray(tree.mask[b, i]))) == ancestors
            assert depths[i] == len(ancestors) - 1

        # Children of one node carry distinct tokens.
        for node in range(n):
            child_tokens = tokens[parents[1:] == node]
            assert len(set(child_tokens.tolist())) == len(child_tokens)

    # The draft's per-level block: that level's tokens, root position + depth, mask over nodes so far.
    for depth, (blk_tokens, blk_positions, blk_mask) in enumerate(blocks, start=1):
        start, end = level_slice(widths, depth)
        np.testing.assert_array_equal(blk_tokens, tree.tokens[:, start:end])
        np.testing.assert_array_equal(
            blk_positions, np.asarray(root_positions)[:, None] + depth + np.zeros((1, end - start), int)
        )
        np.testing.assert_array_equal(blk_mask, tree.mask[:, start:end, :end])
        assert blk_mask.shape == (batch, end - start, end)


def test_level_slices_and_depths_cover_the_flat_layout():
    widths = DEFAULT_WIDTHS
    assert num_nodes(widths) == 64
    assert level_slice(widths, 0) == (0, 1)
    assert level_slice(widths, 1) == (1, 5)
    assert level_slice(widths, 5) == (53, 64)
    depths = node_depths(widths)
    for d in range(len(widths) + 1):
        start, end = level_slice(widths, d)
        assert (depths[start:end] == d).all()


def test_chain_tree_is_a_causal_chain():
    chain = jnp.array([[4, 5, 6], [7, 8, 9]])
    tree = chain_tree(jnp.array([1, 2]), chain)
    assert tree.widths == (1, 1, 1)
    np.testing.assert_array_equal(tree.tokens, [[1, 4, 5, 6], [2, 7, 8, 9]])
    np.testing.assert_array_equal(tree.parents[0], [-1, 0, 1, 2])
    np.testing.assert_array_equal(tree.mask[1], np.tril(np.ones((4, 4), bool)))


def node_path(tree, b, node):
    """numpy: the flat nodes from the root down to `node` of row b, by its parents."""
    parents = np.asarray(tree.parents[b])
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(int(parents[path[-1]]))
    return path[::-1]


def draft_tree_with_chain(widths, chain_tokens, seed=0, vocab=6):
    rng = np.random.default_rng(seed)
    lps = [jnp.asarray(random_log_probs(rng, (2, vocab)))] + [
        jnp.asarray(random_log_probs(rng, (2, w, vocab))) for w in widths[:-1]
    ]
    tree, _ = build(widths, jnp.array([1, 2]), lps, jnp.array([10, 20]))
    chain = jnp.asarray(rng.integers(0, vocab, (2, chain_tokens)), jnp.int32)
    return tree, chain, with_lookup_chain(tree, chain)


@pytest.mark.parametrize("widths,chain_tokens", [((2, 3), 4), ((3, 4, 2), 2), ((2, 2), 2)])
def test_a_lookup_chain_beside_a_tree_keeps_both_in_level_order(widths, chain_tokens):
    tree, chain, combined = draft_tree_with_chain(widths, chain_tokens)
    assert combined.widths == lookup_widths(widths, chain_tokens)
    assert sum(combined.widths) == sum(widths) + chain_tokens
    depths = node_depths(combined.widths)
    for b in range(2):
        mask = np.asarray(combined.mask[b])
        tokens = np.asarray(combined.tokens[b])
        parents = np.asarray(combined.parents[b])
        for node in range(num_nodes(combined.widths)):
            path = node_path(combined, b, node)
            assert len(path) == depths[node] + 1  # a node's level is its depth
            np.testing.assert_array_equal(np.flatnonzero(mask[node]), sorted(path))  # it sees its ancestors
        # The chain: the last node of levels 1..L, each the child of the one above.
        chain_nodes = [level_slice(combined.widths, d)[1] - 1 for d in range(1, chain_tokens + 1)]
        np.testing.assert_array_equal(tokens[chain_nodes], np.asarray(chain[b]))
        assert parents[chain_nodes[0]] == 0 and list(parents[chain_nodes[1:]]) == chain_nodes[:-1]
        # The draft's nodes: the same token paths as in the tree alone.
        draft_paths = {tuple(np.asarray(tree.tokens[b])[node_path(tree, b, n)]) for n in range(num_nodes(widths))}
        kept = {
            tuple(tokens[node_path(combined, b, n)]) for n in range(num_nodes(combined.widths)) if n not in chain_nodes
        }
        assert kept == draft_paths


def picks_following(tree, continuation):
    """int32[B, N]: at each node, the continuation's next token if the node's path (below the root)
    is a prefix of it, else a token no node carries (-1 never matches)."""
    picks = np.full(tree.tokens.shape, -1, np.int32)
    for b, want in enumerate(continuation):
        for node in range(tree.tokens.shape[1]):
            path = list(np.asarray(tree.tokens[b])[node_path(tree, b, node)][1:])
            if path == list(want[: len(path)]) and len(path) < len(want):
                picks[b, node] = want[len(path)]
    return jnp.asarray(picks)


def test_the_walk_keeps_the_longer_of_the_draft_branch_and_the_lookup_chain():
    """Row 0's continuation follows a draft branch for two tokens, row 1's the chain for all four:
    each keeps what it would keep with the better of the two alone, and the tokens match."""
    tree, chain, combined = draft_tree_with_chain((2, 3), 4, vocab=6)
    deepest = level_slice(tree.widths, 2)[0]  # a depth-2 node of row 0
    branch = list(np.asarray(tree.tokens[0])[node_path(tree, 0, deepest)][1:])
    continuation = [branch + [5, 5, 5], list(np.asarray(chain[1])) + [4]]
    alone = [accept(t, picks_following(t, continuation)) for t in (tree, chain_tree(tree.tokens[:, 0], chain))]
    both = accept(combined, picks_following(combined, continuation))
    best = np.maximum(*(np.asarray(a.n_emitted) for a in alone))
    np.testing.assert_array_equal(both.n_emitted, best)
    # Row 0 kept the draft's whole branch, row 1 the whole chain, each with its bonus.
    assert int(alone[0].n_emitted[0]) == 3 and int(alone[1].n_emitted[1]) == 5
    for b in range(2):
        n = int(both.n_emitted[b])
        assert list(np.asarray(both.emitted[b, :n])) == continuation[b][:n]


def test_a_chain_token_equal_to_a_draft_siblings_is_walked_as_one_path():
    """A chain whose tokens repeat a draft branch: both copies are reached; the walk still emits
    the continuation once, as deep as either copy goes."""
    tree, _, _ = draft_tree_with_chain((2, 3), 3, vocab=6)
    deepest = level_slice(tree.widths, 2)[0]
    branch = [list(np.asarray(tree.tokens[b])[node_path(tree, b, deepest)][1:]) for b in range(2)]
    chain = jnp.asarray([branch[0] + [3], branch[1] + [0]], jnp.int32)  # the branch, one token further
    combined = with_lookup_chain(tree, chain)
    continuation = [branch[0] + [3, 1], branch[1] + [1, 1]]
    acc = accept(combined, picks_following(combined, continuation))
    np.testing.assert_array_equal(acc.n_emitted, [4, 3])
    for b in range(2):
        assert list(np.asarray(acc.emitted[b, : int(acc.n_emitted[b])])) == continuation[b][: int(acc.n_emitted[b])]


@pytest.mark.parametrize(
    "widths,match",
    [
        ((), "depth >= 1"),
        ((4, 0, 2), ">= 1"),
        ((11,), "exceeds"),
        ((2, 30), "exceeds"),
        ((8,) * 16, "at most 128"),
        (("a",), "integers"),
    ],
)
def test_bad_widths_raise_user_error(widths, match):
    with pytest.raises(UserError, match=match):
        validate_widths(widths, vocab_size=10)


def test_good_widths_pass_validation():
    assert validate_widths([4, 16, 16, 16, 11], vocab_size=32000) == DEFAULT_WIDTHS
    assert validate_widths((2, 20), vocab_size=10) == (2, 20)


@pytest.mark.parametrize(
    "shape, k",
    [((1, 4, 49152), 16), ((16, 5000), 16), ((2, 3, 3001), 9), ((1, 7000), 8), ((1, 4, 49152), 4), ((64, 3000), 2)],
)
def test_vocab_top_k_equals_one_stage_top_k_ties_and_minus_inf_included(shape, k):
    rng = np.random.default_rng(k)
    # Few distinct values: ties everywhere, across slices too; some rows' tails at -inf.
    scores = rng.integers(0, 12, shape).astype(np.float32)
    scores[..., shape[-1] // 3 :: 7] = -np.inf
    values, index = vocab_top_k(jnp.asarray(scores), k)
    want_values, want_index = jax.lax.top_k(jnp.asarray(scores), k)
    np.testing.assert_array_equal(values, want_values)
    np.testing.assert_array_equal(index, want_index)


def test_vocab_top_k_with_fewer_finite_scores_than_k_still_gives_distinct_indices():
    scores = np.full((3, 6000), -np.inf, np.float32)
    scores[0, [5, 4000]] = [1.0, 2.0]
    scores[1, 17] = 0.0  # row 2 is all -inf
    values, index = vocab_top_k(jnp.asarray(scores), 4)
    want_values, want_index = jax.lax.top_k(jnp.asarray(scores), 4)
    np.testing.assert_array_equal(values, want_values)
    np.testing.assert_array_equal(index, want_index)
    assert all(len(set(row)) == 4 for row in np.asarray(index).tolist())


def test_vocab_top_k_takes_two_stages_where_it_is_faster():
    # Two stages: the program holds two top-ks; one stage for many rows; argmax passes, no top-k,
    # for a small k over a large vocabulary.
    def top_ks(shape, k):
        text = jax.jit(lambda x: vocab_top_k(x, k)).lower(jnp.zeros(shape, jnp.float32)).as_text()
        return text.count("chlo.top_k")

    assert top_ks((4, 49152), 16) == 2 and top_ks((64, 49152), 16) == 1
    assert top_ks((4, 49152), 4) == 0 and top_ks((4, 1000), 4) == 1
