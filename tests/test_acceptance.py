import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from longspec_jax.acceptance import accept_drawn_chain, accept_greedy, accept_sampling
from longspec_jax.sampling import SamplingParams, filtered_log_probs
from longspec_jax.tree import chain_tree, expand_level, init_tree, node_depths

WIDTHS = (2, 3, 3)
VOCAB = 6


def random_log_probs(rng, shape):
    logits = rng.normal(size=shape) * 1.5
    return logits - np.log(np.exp(logits).sum(-1, keepdims=True))


def random_tree(rng, batch, widths, vocab):
    """A beam tree built from random draft log-probs; also returns those log-probs per level."""
    level_lps = [random_log_probs(rng, (batch, vocab))] + [
        random_log_probs(rng, (batch, w, vocab)) for w in widths[:-1]
    ]
    tree = init_tree(jnp.zeros((batch,), jnp.int32), jnp.asarray(level_lps[0], jnp.float32), widths)
    for depth in range(1, len(widths)):
        tree = expand_level(tree, depth, jnp.asarray(level_lps[depth], jnp.float32))
    return tree, level_lps


def greedy_reference(tokens, parents, target_argmax):
    """numpy, by definition: the deepest node whose whole ancestor chain matches the target's argmax."""
    n = len(tokens)

    def chain(i):
        out = []
        while i > 0:
            out.append(i)
            i = parents[i]
        return out[::-1]

    verified = [i for i in range(n) if all(tokens[j] == target_argmax[parents[j]] for j in chain(i))]
    deepest = max(verified, key=lambda i: len(chain(i)))  # unique: siblings carry distinct tokens
    path = [0] + chain(deepest)
    emitted = [int(tokens[j]) for j in path[1:]] + [int(target_argmax[deepest])]
    return path, emitted


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_matches_brute_force_walk(seed):
    rng = np.random.default_rng(seed)
    batch = 24
    tree, _ = random_tree(rng, batch, WIDTHS, VOCAB)
    tokens, parents = np.asarray(tree.tokens), np.asarray(tree.parents)
    n = tokens.shape[1]
    logits = rng.normal(size=(batch, n, VOCAB))
    # Make the target agree with some child most of the time so long paths occur; force the two
    # extremes explicitly: row 0 rejects everything, row 1 accepts a full-depth path.
    for b in range(batch):
        for i in range(n):
            children = np.flatnonzero(parents[b] == i)
            if len(children) and rng.random() < 0.75:
                logits[b, i, tokens[b, rng.choice(children)]] += 20.0
    root_children = tokens[0, parents[0] == 0]
    logits[0, 0] = -20.0
    logits[0, 0, [t for t in range(VOCAB) if t not in root_children][0]] = 20.0
    node = 0
    while (parents[1] == node).any():
        child = np.flatnonzero(parents[1] == node)[0]
        logits[1, node] = -20.0
        logits[1, node, tokens[1, child]] = 20.0
        node = child

    result = jax.jit(accept_greedy)(tree, jnp.asarray(logits, jnp.float32))
    target_argmax = logits.argmax(-1)
    lengths = []
    for b in range(batch):
        path, emitted = greedy_reference(tokens[b], parents[b], target_argmax[b])
        k = len(emitted)
        lengths.append(k)
        assert int(result.n_emitted[b]) == k == len(path)
        np.testing.assert_array_equal(result.path[b, :k], path)
        np.testing.assert_array_equal(result.emitted[b, :k], emitted)
        assert (np.asarray(result.path[b, k:]) == 0).all() and (np.asarray(result.emitted[b, k:]) == 0).all()
        assert int(result.bonus[b]) == emitted[-1]
    assert lengths[0] == 1 and lengths[1] == len(WIDTHS) + 1
    assert len(set(lengths)) >= 3  # the random rows exercise intermediate depths too


# --- sampling exactness -------------------------------------------------------------------------

SAMPLE_WIDTHS = (2, 2)
SAMPLE_VOCAB = 4
NUM_SAMPLES = 6000


def filtered_probs(logits, temperature, top_p):
    """numpy reference of the target's sampling distribution: temperature, then nucleus (top-p)."""
    z = logits / temperature
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    order = np.argsort(-p, axis=-1)
    sorted_p = np.take_along_axis(p, order, -1)
    keep_sorted = np.cumsum(sorted_p, -1) - sorted_p < top_p  # smallest prefix reaching mass top_p
    keep = np.zeros_like(keep_sorted)
    np.put_along_axis(keep, order, keep_sorted, -1)
    p = np.where(keep, p, 0.0)
    return p / p.sum(-1, keepdims=True)


def sampling_setup(temperature, top_p, seed=3):
    """A fixed tree and a tiny "model": raw target logits at each context of up to 2 tokens.

    Returns the tree, the draft log-probs it was built from, the raw target logits at every flat
    node [N, V], and the exact (numpy) sampling distributions at the root and after one token."""
    rng = np.random.default_rng(seed)
    tree, draft_lps = random_tree(rng, 1, SAMPLE_WIDTHS, SAMPLE_VOCAB)
    v = SAMPLE_VOCAB
    logits_root = rng.normal(size=v) * 1.5
    logits_after1 = rng.normal(size=(v, v)) * 1.5  # [first token] -> next
    logits_after2 = rng.normal(size=(v, v, v)) * 1.5
    tokens, parents = np.asarray(tree.tokens[0]), np.asarray(tree.parents[0])
    depths = node_depths(SAMPLE_WIDTHS)
    node_logits = []
    for i in range(len(tokens)):
        if depths[i] == 0:
            node_logits.append(logits_root)
        elif depths[i] == 1:
            node_logits.append(logits_after1[tokens[i]])
        else:
            node_logits.append(logits_after2[tokens[parents[i]], tokens[i]])
    p_root = filtered_probs(logits_root, temperature, top_p)
    p_after1 = filtered_probs(logits_after1, temperature, top_p)
    return tree, draft_lps, np.stack(node_logits), p_root, p_after1


def first_two_tokens(emitted, n_emitted, p_after1, key):
    """Second token: from this round when it emitted >= 2, else what the next round's root sample gives."""
    next_round = jax.random.categorical(key, jnp.log(jnp.asarray(p_after1, jnp.float32))[emitted[:, 0]])
    return np.asarray(emitted[:, 0]), np.where(
        np.asarray(n_emitted) >= 2, np.asarray(emitted[:, 1]), np.asarray(next_round)
    )


def chi_square_p(first, second, p_root, p_after1):
    v = SAMPLE_VOCAB
    observed = np.bincount(first * v + second, minlength=v * v).astype(float)
    expected = (p_root[:, None] * p_after1).reshape(-1) * len(first)
    assert observed[expected == 0].sum() == 0  # top-p-removed tokens never appear
    support = expected > 0
    return stats.chisquare(observed[support], expected[support]).pvalue


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.0, 0.8)])
def test_sampling_first_two_tokens_are_target_distributed(temperature, top_p):
    tree, _, node_logits, p_root, p_after1 = sampling_setup(temperature, top_p)
    batched = jax.tree.map(lambda x: jnp.broadcast_to(x, (NUM_SAMPLES,) + x.shape[1:]), tree)
    params = SamplingParams.create(temperature=temperature, top_p=top_p)
    log_probs = filtered_log_probs(jnp.asarray(node_logits, jnp.float32), params)
    log_probs = jnp.broadcast_to(log_probs, (NUM_SAMPLES,) + log_probs.shape)
    key_round, key_next = jax.random.split(jax.random.key(11))
    result = jax.jit(accept_sampling)(batched, log_probs, key_round)
    first, second = first_two_tokens(result.emitted, result.n_emitted, p_after1, key_next)
    assert (np.asarray(result.n_emitted) >= 2).mean() > 0.2  # the tree path is really exercised
    assert chi_square_p(first, second, p_root, p_after1) > 1e-3


def broken_rule_first_two(tree, draft_lps, node_probs, p_after1, rng):
    """node_probs [N, V]: the target distribution at every flat node.

    The reference code's kind of rule (speculative sampling as if candidates were drawn from the
    draft): try each child t in turn, accept with prob min(1, p(t) / q(t)), else p <- norm(max(p - q, 0))."""
    tokens, parents = np.asarray(tree.tokens[0]), np.asarray(tree.parents[0])
    draft_q = [np.exp(draft_lps[0][0])] + [np.exp(x) for x in draft_lps[1][0]]  # at root, at depth-1 nodes
    out = []
    for _ in range(NUM_SAMPLES):
        node, emitted = 0, []
        while len(emitted) < 2:
            p = node_probs[node].copy()
            q = draft_q[node]  # only the root and depth-1 nodes are visited before 2 tokens
            moved = False
            for child in np.flatnonzero(parents == node):
                t = tokens[child]
                if rng.random() < min(1.0, p[t] / q[t]):
                    emitted.append(t)
                    node, moved = child, True
                    break
                residual = np.maximum(p - q, 0.0)
                p = residual / residual.sum() if residual.sum() > 0 else p
            if not moved:
                emitted.append(rng.choice(SAMPLE_VOCAB, p=p))
                if len(emitted) < 2:
                    emitted.append(rng.choice(SAMPLE_VOCAB, p=p_after1[emitted[0]]))
        out.append(emitted[:2])
    out = np.array(out)
    return out[:, 0], out[:, 1]


def test_chi_square_catches_the_reference_rule_for_deterministic_candidates():
    tree, draft_lps, node_logits, p_root, p_after1 = sampling_setup(1.0, 1.0)
    node_probs = filtered_probs(node_logits, 1.0, 1.0)
    first, second = broken_rule_first_two(tree, draft_lps, node_probs, p_after1, np.random.default_rng(5))
    assert chi_square_p(first, second, p_root, p_after1) < 1e-3


# --- chains drawn from the draft: speculative sampling ------------------------------------------


def drawn_chain_setup(temperature, top_p, draw, seed=4):
    """NUM_SAMPLES depth-2 chains over SAMPLE_VOCAB tokens, x1 from q0 and x2 from q1[x1] by
    `draw(rng, q)` (a true draw, or something else to show the test can fail), and the target's
    logits at each chain's three nodes. -> (tree with drawn_from, node logits [S, 3, V], q0, p_root,
    p_after1)."""
    rng = np.random.default_rng(seed)
    v = SAMPLE_VOCAB
    q0 = np.exp(random_log_probs(rng, (v,)))
    q1 = np.exp(random_log_probs(rng, (v, v)))  # [x1] -> the draft's next distribution
    logits_root = rng.normal(size=v) * 1.5
    logits_after1 = rng.normal(size=(v, v)) * 1.5
    logits_after2 = rng.normal(size=(v, v, v)) * 1.5
    x1 = np.array([draw(rng, q0) for _ in range(NUM_SAMPLES)])
    x2 = np.array([draw(rng, q1[a]) for a in x1])
    tree = chain_tree(jnp.zeros((NUM_SAMPLES,), jnp.int32), jnp.asarray(np.stack([x1, x2], 1), jnp.int32))
    drawn_from = np.stack([np.broadcast_to(q0, (NUM_SAMPLES, v)), q1[x1]], axis=1)
    # drawn_from holds logits: log-probs up to a constant per row.
    logits = np.log(drawn_from) + 3.0 * rng.normal(size=(NUM_SAMPLES, 2, 1))
    tree = tree.replace(drawn_from=jnp.asarray(logits, jnp.float32))
    node_logits = np.stack(
        [np.broadcast_to(logits_root, (NUM_SAMPLES, v)), logits_after1[x1], logits_after2[x1, x2]], 1
    )
    p_root = filtered_probs(logits_root, temperature, top_p)
    p_after1 = filtered_probs(logits_after1, temperature, top_p)
    return tree, node_logits, q0, p_root, p_after1


def run_drawn_chain(tree, node_logits, temperature, top_p, seed=12):
    params = SamplingParams.create(temperature=temperature, top_p=top_p)
    log_probs = filtered_log_probs(jnp.asarray(node_logits, jnp.float32), params)
    key_round, key_next = jax.random.split(jax.random.key(seed))
    return jax.jit(accept_drawn_chain)(tree, log_probs, key_round, params.greedy), key_next


def true_draw(rng, q):
    return rng.choice(len(q), p=q)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.0, 0.8)])
def test_drawn_chain_first_two_tokens_are_target_distributed(temperature, top_p):
    tree, node_logits, q0, p_root, p_after1 = drawn_chain_setup(temperature, top_p, true_draw)
    result, key_next = run_drawn_chain(tree, node_logits, temperature, top_p)
    first, second = first_two_tokens(result.emitted, result.n_emitted, p_after1, key_next)
    n = np.asarray(result.n_emitted)
    assert (n == 3).mean() > 0.05 and (n == 1).mean() > 0.05  # whole chains and first rejections happen
    assert chi_square_p(first, second, p_root, p_after1) > 1e-3
    # The first token is kept with probability sum_x min(p(x), q(x)) (within 4 standard errors).
    overlap = np.minimum(p_root, q0).sum()
    assert abs((n >= 2).mean() - overlap) < 4 * np.sqrt(overlap * (1 - overlap) / NUM_SAMPLES)
    path = np.asarray(result.path)
    steps = np.arange(3)[None, :]
    np.testing.assert_array_equal(path, np.where(steps < n[:, None], steps, 0))
    np.testing.assert_array_equal(np.asarray(result.bonus), np.asarray(result.emitted)[np.arange(len(n)), n - 1])


def test_chi_square_catches_a_chain_not_drawn_from_its_distribution():
    """The rule is exact only for tokens drawn from drawn_from: the draft's likeliest tokens under
    the same bookkeeping are biased, and the test sees it."""
    tree, node_logits, _, p_root, p_after1 = drawn_chain_setup(1.0, 1.0, lambda rng, q: int(np.argmax(q)))
    result, key_next = run_drawn_chain(tree, node_logits, 1.0, 1.0)
    first, second = first_two_tokens(result.emitted, result.n_emitted, p_after1, key_next)
    assert chi_square_p(first, second, p_root, p_after1) < 1e-3


def test_drawn_chain_when_greedy_is_greedy_acceptance():
    """Greedy: the target's and the draft's distributions are point masses, so the rule keeps a
    token iff it is the target's argmax and the bonus is the argmax where the chain stops."""
    rng = np.random.default_rng(6)
    batch, depth = 64, 3
    node_logits = rng.normal(size=(batch, depth + 1, VOCAB))
    argmax = node_logits.argmax(-1)
    # Agree with the target most of the time so every path length occurs.
    chain = np.where(rng.random((batch, depth)) < 0.7, argmax[:, :depth], (argmax[:, :depth] + 1) % VOCAB)
    tree = chain_tree(jnp.zeros((batch,), jnp.int32), jnp.asarray(chain, jnp.int32))
    drawn_from = np.where(np.arange(VOCAB)[None, None, :] == chain[:, :, None], 0.0, -np.inf)
    tree = tree.replace(drawn_from=jnp.asarray(drawn_from, jnp.float32))
    params = SamplingParams.create(0.0)
    log_probs = filtered_log_probs(jnp.asarray(node_logits, jnp.float32), params)
    result = jax.jit(accept_drawn_chain)(tree, log_probs, jax.random.key(0), params.greedy)
    for b in range(batch):
        parents = np.arange(-1, depth)
        _, emitted = greedy_reference(np.concatenate([[0], chain[b]]), parents, argmax[b])
        n = int(result.n_emitted[b])
        assert np.asarray(result.emitted[b, :n]).tolist() == emitted
    assert set(np.asarray(result.n_emitted).tolist()) == set(range(1, depth + 2))
