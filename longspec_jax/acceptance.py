"""Accepting a verified draft tree: exact greedy and exact sampling (docs/ALGORITHM.md 5.5-5.6).

Both rules are one walk from the root (`accept`): at the current node take the target's pick x
there (argmax for greedy, a sample for sampling; `sampling.pick_token` draws one per node, each
with its own randomness); if a child carries x, move to it and repeat, otherwise x is the bonus
token and the round stops. Picks at nodes off the walk are never used, so drawing one at every
node up front is the same as drawing them along the walk. Children of one node carry distinct
tokens (tree.py guarantees it), so "the child with token x" is unique. Every emitted token is
therefore the target's own pick given everything emitted before it: greedy output equals
target-only greedy decoding, and sampled output is exactly distributed as target-only sampling,
whatever the draft proposed. (The reference code's rule, accepting a child with probability
min(1, p_target / p_draft), is only valid for candidates *sampled* from the draft; beam candidates
are deterministic, which biases it.)

Coupled candidates (`Tree.noise`, a draft tree when sampling): the picks need not be independent
across nodes, only each emitted token must be the target's exact sample given the tokens before it.
So every node of depth d picks with one shared Gumbel noise g_d (argmax of its filtered logits + g_d:
an exact sample of its distribution), g_0, g_1, ... independent, and the draft chose level d + 1 by
racing its own filtered logits under the same g_d (draft.candidates_from_logits): where the
draft's distribution is close to the target's, the target's pick is then a candidate far more often
than an independent sample would be. Exactness: the walk emits x_1 = argmax(log p_root + g_0), x_2 = argmax(log
p(.|x_1) + g_1), ..., the tokens target-only sampling with these noises would emit, and it stops at
the first x_{d+1} that no child carries, an event decided by g_0..g_d and the draft alone (the draft
chose depth d + 1 from g_d and the tokens above), never by noise of a later depth. A round's stop
thus depends only on the noise already spent, and the next round draws new noise, so the emitted
stream is distributed as target-only sampling (the stopping-time argument of coupling-based
speculative sampling). Measured on the CPU with the shipped SmolLM2 draft at T = 1 (BENCHMARKS.md),
a (4, 4, 4) tree kept 2.33 / 2.03 tokens a round (code / summaries) with coupled picks against
1.71 / 1.50 with independent ones.

A chain whose tokens *were* drawn from the draft (`Tree.drawn_from`: a draft chain, proposers.py)
is verified by that rule instead, speculative sampling (`accept_drawn_chain`): a drawn token is kept
with probability min(1, p(x) / q(x)), and where one is not, the bonus comes from the residual
max(p - q, 0). Its tokens are also exactly target-distributed, and a token is kept with probability
sum_x min(p(x), q(x)), where a deterministic candidate is kept with p(its token) alone: with the
shipped SmolLM2 draft at T = 1 a round of one drawn token keeps 1.51 tokens on code where one of the
draft's likeliest keeps 1.27 (BENCHMARKS.md).

Outputs (D = tree depth, static):
  path:      int32[B, D+1]  flat node indices walked: the root, then each accepted node; 0 past the end.
  n_emitted: int32[B]       tokens emitted this round = accepted draft tokens + 1 (the bonus), which
                            is also the number of valid `path` entries (root + accepted nodes), i.e.
                            the `n_accept` of model.commit(cache, path, n_emitted).
  emitted:   int32[B, D+1]  the accepted draft tokens in order, then the bonus; 0 past n_emitted.
  bonus:     int32[B]       the last emitted token: the next round's root.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from longspec_jax.tree import Tree


@struct.dataclass
class Acceptance:
    path: jax.Array
    n_emitted: jax.Array
    emitted: jax.Array
    bonus: jax.Array


def accept(tree: Tree, picks: jax.Array) -> Acceptance:
    """Walk down the tree; picks int32[B, N]: the target's choice at every flat node.

    The walk is computed without stepping: a node is reached iff it and each of its ancestors
    carries its parent's pick (the tree mask lists the ancestors), and the walk ends at the deepest
    node reached (unique: siblings carry distinct tokens, a pick is one token). So it is a few fused
    element-wise ops and reductions, not a loop of D + 1 dependent steps of small kernels each.
    A tree of the root alone (depth 0, as AR proposes) emits the root's pick and walks nothing."""
    b, n = tree.tokens.shape
    if tree.depth == 0:
        pick = picks[:, :1].astype(jnp.int32)
        zeros = jnp.zeros((b, 1), jnp.int32)
        return Acceptance(path=zeros, n_emitted=jnp.ones((b,), jnp.int32), emitted=pick, bonus=pick[:, 0])
    picks = picks.astype(jnp.int32)
    steps = tree.depth + 1  # at most D moves, then the bonus pick at a depth-D leaf
    depths = jnp.asarray(tree.depths)  # [N]
    parent_pick = jnp.take_along_axis(picks, jnp.maximum(tree.parents, 0), axis=1)
    agrees = (tree.tokens == parent_pick) | (tree.parents < 0)  # the root always agrees
    diagonal = jnp.diagonal(tree.mask, axis1=1, axis2=2)  # False for nodes of unbuilt levels
    reached = diagonal & jnp.all(~tree.mask | agrees[:, None, :], axis=2)  # [B, N]
    last = jnp.argmax(jnp.where(reached, depths[None, :], -1), axis=1).astype(jnp.int32)
    n_moves = depths[last]
    on_path = _at_node(tree.mask, last)  # [B, N]: the walk's nodes, the root included
    at_step = on_path[:, :, None] & (depths[None, :, None] == jnp.arange(steps)[None, None, :])  # [B, N, D+1]
    nodes = jnp.arange(n, dtype=jnp.int32)[None, :, None]
    path = jnp.sum(jnp.where(at_step, nodes, 0), axis=1)  # [B, D+1], 0 past the end
    # Emitted: the target's picks along the walk, then zeros. Each node below the root carries its
    # parent's pick, so these are the walk's tokens below the root, then the bonus (the last node's
    # pick). Read from the picks rather than the tree's tokens: fused into this sum, the tokens were
    # rebuilt from the draft's per-level top-k for every output (one kernel of ~21 us a round on the
    # H200 at the default tree).
    path_picks = jnp.sum(jnp.where(at_step, picks[:, :, None], 0), axis=1)
    step = jnp.arange(steps)[None, :]
    emitted = jnp.where(step <= n_moves[:, None], path_picks, 0)
    return Acceptance(path=path, n_emitted=n_moves + 1, emitted=emitted, bonus=_at_node(picks, last))


def accept_drawn_chain(tree: Tree, log_probs: jax.Array, key: jax.Array, greedy: jax.Array) -> Acceptance:
    """Speculative sampling down a chain drawn from the draft (module doc). log_probs float32[B, D+1, V]:
    the target's filtered log-probs at every node (`sampling.filtered_log_probs`: point masses when
    greedy, which makes this greedy acceptance); key: used once a round; greedy bool[]: no noise.

    Node d + 1's token x was drawn from q = softmax(tree.drawn_from[:, d]) (greedy: the point mass
    on x); with p = the target's distribution at node d, it is kept with probability
    min(1, p(x) / q(x)) while every token before it was. The bonus is drawn from max(p - q, 0) at
    the parent of the first token not kept, or from p at the last node when all were. All uniforms
    and bonus draws are made up front, one per node (those off the outcome are never used), so there
    is no loop of dependent steps."""
    depth = tree.depth
    b, _ = tree.tokens.shape
    chain = tree.tokens[:, 1:]  # [B, D]
    vocab = log_probs.shape[-1]
    point_mass = jnp.where(jax.nn.one_hot(chain, vocab, dtype=bool), 0.0, -jnp.inf)
    q = jnp.where(greedy, point_mass, jax.nn.log_softmax(tree.drawn_from.astype(jnp.float32), axis=-1))  # [B, D, V]
    p_of_x = jnp.take_along_axis(log_probs[:, :depth], chain[:, :, None], axis=-1)[..., 0]
    q_of_x = jnp.take_along_axis(q, chain[:, :, None], axis=-1)[..., 0]
    key_keep, key_bonus = jax.random.split(key)
    # u < p / q, in logs; u = 0 keeps x only where p(x) > 0.
    kept = jnp.log(jax.random.uniform(key_keep, (b, depth))) < p_of_x - q_of_x
    n_moves = jnp.sum(jnp.cumprod(kept.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    residual = jnp.log(jnp.maximum(jnp.exp(log_probs[:, :depth]) - jnp.exp(q), 0.0))
    # Rounding can leave no mass where p and q nearly agree: then p itself (never reached exactly).
    residual = jnp.where(jnp.any(residual > -jnp.inf, axis=-1, keepdims=True), residual, log_probs[:, :depth])
    bonus_from = jnp.concatenate([residual, log_probs[:, depth:]], axis=1)  # [B, D+1, V]
    noise = jax.random.gumbel(key_bonus, bonus_from.shape, jnp.float32)
    draws = jnp.argmax(bonus_from + jnp.where(greedy, 0.0, noise), axis=-1).astype(jnp.int32)  # [B, D+1]
    bonus = jnp.take_along_axis(draws, n_moves[:, None], axis=1)[:, 0]
    step = jnp.arange(depth + 1, dtype=jnp.int32)[None, :]
    path = jnp.where(step <= n_moves[:, None], step, 0)
    tokens = jnp.pad(chain.astype(jnp.int32), ((0, 0), (0, 1)))
    emitted = jnp.where(step < n_moves[:, None], tokens, jnp.where(step == n_moves[:, None], bonus[:, None], 0))
    return Acceptance(path=path, n_emitted=n_moves + 1, emitted=emitted, bonus=bonus)


def _at_node(values: jax.Array, node: jax.Array) -> jax.Array:
    """values [B, N, ...] -> values[b, node[b]]."""
    return jnp.take_along_axis(values, node.reshape((-1, 1) + (1,) * (values.ndim - 2)), axis=1)[:, 0]


def accept_greedy(tree: Tree, target_logits: jax.Array) -> Acceptance:
    """Greedy acceptance: target_logits float[B, N, V] at every flat node of `tree`.

    The accepted path is the deepest one whose every token equals the target's argmax at its parent.
    """
    return accept(tree, jnp.argmax(target_logits, axis=-1).astype(jnp.int32))


def accept_sampling(tree: Tree, target_log_probs: jax.Array, key: jax.Array) -> Acceptance:
    """Exact sampling acceptance: target_log_probs float[B, N, V] at every flat node, already
    filtered (temperature / top-k / top-p: sampling.py), and a PRNG key used once per round:
    an independent sample at every node."""
    return accept(tree, jax.random.categorical(key, target_log_probs, axis=-1).astype(jnp.int32))
