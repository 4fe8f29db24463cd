"""The device loop after prefill: one jitted `lax.while_loop` of rounds, the same for every mode.

A round, for every sequence of the batch at once (docs/ALGORITHM.md 5):
  1. propose: the proposer (proposers.py) builds a tree rooted at the last emitted token (the
     root, not in the target cache yet). AR's proposer proposes nothing: the tree of the root
     alone, so an AR round is one decode step;
  2. verify: one target `forward_block` over the N tree nodes at positions root position + depth
     under the tree mask (hybrid tree attention: the cache plus the nodes' own K/V), which returns
     the nodes' K/V, or with the Pallas kernels writes them past the cache end (a root-only tree
     writes its row there: AR decoding);
  3. accept: the target's pick at every node (`sampling.pick_token`: argmax when greedy, an exact
     sample otherwise; one program for both; a draft tree's nodes of one depth share the noise its
     candidates were chosen with, `Tree.noise`), then the walk down the tree (acceptance.py), cut
     at the first EOS / at max_new_tokens; a chain drawn from the draft is verified by speculative
     sampling instead (`acceptance.accept_drawn_chain`);
  4. commit: the K/V of the root and the kept nodes are written in path order at the cache end,
     from the verified nodes' K/V wherever verify left them (model.commit); the last kept token is
     the next root;
     the proposer is told what was kept.
Finished sequences still ride along through the forwards (static shapes) but keep nothing.

`LoopConfig` holds the static settings (one compiled program per distinct value), `LoopState` the
carry. Lengths, limits and sampling values are arrays, so nothing recompiles per prompt.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct

from longspec_jax.acceptance import Acceptance, accept, accept_drawn_chain
from longspec_jax.adaptive import Adaptive
from longspec_jax.decode_kit import StopRule
from longspec_jax.model import BlockKV, KVCache, Transformer, commit
from longspec_jax.policy import (
    AR,
    ar_rounds_before_a_retry,
    batch_progress,
    choose,
    count_rounds,
    record,
    record_ar_rounds,
    with_costs_and_memory,
)
from longspec_jax.proposers import write_rows
from longspec_jax.sampling import SamplingParams, filtered_log_probs, pick_token, pick_with_noise
from longspec_jax.tree import Tree, node_depths


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """Static settings of the loop. graphdef: the target's (nnx.split); proposer: a frozen
    proposer (proposers.py); new_bucket: the output length the buffers are sized for (>=
    max_new_tokens); attn_impl: the target's attention implementation."""

    graphdef: Any
    proposer: Any
    new_bucket: int
    attn_impl: str

    @property
    def depth(self) -> int:
        return len(self.proposer.widths)


@struct.dataclass
class LoopState:
    """The loop's carry. roots int32[B]: the last emitted token of each sequence; out
    int32[B, new_bucket + D + 1]: the generated tokens, valid up to n_new[b] (the room past the
    bucket takes a round's full write); rounds: target forwards so far; active_rounds int32[B]:
    rounds each sequence ran while not done (tau = tokens kept by rounds, sum(n_new - 1), over
    their sum)."""

    cache: KVCache
    proposal: Any
    roots: jax.Array
    out: jax.Array
    n_new: jax.Array
    done: jax.Array
    key: jax.Array
    rounds: jax.Array
    active_rounds: jax.Array
    stop: StopRule


# ----------------------------------------------------------------------------- one round


def round_key(state: LoopState) -> jax.Array:
    """This round's randomness: the target's picks (or a drawn chain's acceptance) use it, a
    proposer that draws uses `propose_key`."""
    return jax.random.fold_in(state.key, state.rounds + 1)


def propose_key(state: LoopState) -> jax.Array:
    return jax.random.fold_in(round_key(state), 1)


def propose(config: LoopConfig, proposer_params, model: Transformer, state: LoopState, sampling: SamplingParams):
    """-> (tree, proposer state)."""
    return config.proposer.propose(
        proposer_params,
        model,
        state.proposal,
        state.roots,
        state.cache,
        config.attn_impl,
        sampling,
        propose_key(state),
    )


def verify(config: LoopConfig, model: Transformer, tree: Tree, cache: KVCache):
    """-> (target logits float32[B, N, V] at every node, the cache, the nodes' BlockKV). Rows up to
    the cache's lengths are unchanged; past them it may hold the nodes' rows (a root-only tree's
    always, a larger tree's with impl "pallas": `forward_block`)."""
    positions = cache.lengths[:, None] + jnp.asarray(node_depths(tree.widths))[None, :]
    return model.forward_block(tree.tokens, positions, tree.mask, cache, attn_impl=config.attn_impl)


def _keep(acc: Acceptance, state: LoopState, depth: int):
    """How many of this round's emitted tokens each sequence keeps (through the first EOS, up to
    max_new_tokens; 0 once done), and whether it ends here."""
    slots = jnp.arange(depth + 1, dtype=jnp.int32)[None, :]
    is_eos = state.stop.is_eos(acc.emitted) & (slots < acc.n_emitted[:, None])
    first_eos = jnp.min(jnp.where(is_eos, slots, depth + 1), axis=1)  # depth + 1: none
    hit_eos = first_eos <= depth
    through_eos = jnp.where(hit_eos, first_eos + 1, acc.n_emitted)
    n_keep = jnp.minimum(through_eos, state.stop.max_new_tokens - state.n_new)
    n_keep = jnp.where(state.done, 0, n_keep).astype(jnp.int32)
    ends = (hit_eos & (through_eos <= n_keep)) | (state.n_new + n_keep >= state.stop.max_new_tokens)
    return n_keep, ends


def accept_and_commit(
    config: LoopConfig,
    state: LoopState,
    tree: Tree,
    logits,
    cache: KVCache,
    block: BlockKV,
    proposal,
    sampling: SamplingParams,
    *,
    update_proposal=None,
    update_reads_counts: bool = False,
) -> LoopState:
    """Steps 3 and 4 of a round, from the verified tree (cache, block: what verify returned).
    update_proposal(emitted, n_keep, positions) -> the proposer state after the round
    (default: the loop's proposer accepts `proposal`); update_reads_counts: it reads the state's
    n_new and done (static)."""
    depth = tree.depth
    if tree.noise is not None:  # coupled candidates: every node picks with its depth's noise
        depth_noise = tree.noise[:, tree.depths]  # [B, N, V]
        acc = accept(tree, pick_with_noise(logits, depth_noise, sampling))
    elif tree.drawn_from is None:
        acc = accept(tree, pick_token(round_key(state), logits, sampling))  # a pick at every node
    else:
        acc = accept_drawn_chain(tree, filtered_log_probs(logits, sampling), round_key(state), sampling.greedy)
    n_keep, ends = _keep(acc, state, depth)
    # The root and the nodes of all kept tokens but the last (the next root) join the cache. A
    # root-only tree (AR) had verify write its row at the cache end: keeping it takes no write.
    if tree.tokens.shape[1] == 1:
        cache = cache.replace(lengths=cache.lengths + n_keep)
    else:
        cache = commit(cache, block, acc.path, n_keep, impl=config.attn_impl)
    if config.depth == 0:
        # One token per round: every live sequence holds rounds + 1 tokens, so one column takes
        # them all (a plain slice update, cheaper than a per-row scatter in the AR step).
        out = jax.lax.dynamic_update_slice(state.out, acc.emitted, (0, state.rounds + 1))
    else:
        out = write_rows(state.out, acc.emitted, state.n_new)
    positions = cache.lengths - n_keep + 1
    n_new, done = state.n_new, state.done
    if update_proposal is None:
        proposal = config.proposer.accept(proposal, acc.emitted, n_keep, positions)
    else:
        proposal = update_proposal(acc.emitted, n_keep, positions)
        if update_reads_counts:  # overwritten once the update has read them: in place, not after a copy
            proposal, n_new, done = jax.lax.optimization_barrier((proposal, n_new, done))
    return state.replace(
        cache=cache,
        proposal=proposal,
        roots=jnp.where(n_keep > 0, acc.bonus, state.roots),
        out=out,
        n_new=n_new + n_keep,
        done=done | ends,
        rounds=state.rounds + 1,
        active_rounds=state.active_rounds + (~state.done).astype(jnp.int32),
    )


def _adaptive_round(config: LoopConfig, model, proposer_params, state: LoopState, sampling, k: int) -> LoopState:
    """One round of candidate k (static) of an adaptive proposer (adaptive.py): its proposer
    proposes and takes what was kept, and the policy records it. The other sources catch up after
    the run (decode)."""
    adaptive = config.proposer
    candidate = adaptive.candidates[k]
    sources = state.proposal.sources
    tree, proposed = candidate.proposer.propose(
        proposer_params[candidate.sources[0]],  # a tree with a lookup chain: the draft's (lookup has none)
        model,
        candidate.state(sources),
        state.roots,
        state.cache,
        config.attn_impl,
        sampling,
        propose_key(state),
    )

    def update(emitted, n_keep, positions):
        # The other sources sit out this candidate's run and catch up after it (decode).
        accepted = candidate.put(sources, candidate.proposer.accept(proposed, emitted, n_keep, positions))
        kept, active = n_keep.sum(), (~state.done).sum()
        policy = state.proposal.policy  # AR rounds are recorded together, and every run counted at its end (decode)
        if k != AR:
            progress = batch_progress(state.n_new, n_keep, ~state.done)
            sampled = jnp.logical_not(sampling.greedy)
            policy = record(policy, jnp.int32(k), kept, active, progress, sampled=sampled, counted=False)
        return state.proposal.replace(sources=accepted, policy=policy)

    logits, cache, block = verify(config, model, tree, state.cache)
    return accept_and_commit(
        config, state, tree, logits, cache, block, None, sampling, update_proposal=update, update_reads_counts=k != AR
    )


def run_round(
    config: LoopConfig, params, proposer_params, state: LoopState, sampling: SamplingParams, candidate: int = 0
) -> LoopState:
    """One round; with an adaptive proposer, of its candidate `candidate` (static)."""
    model = nnx.merge(config.graphdef, params)
    if isinstance(config.proposer, Adaptive):
        return _adaptive_round(config, model, proposer_params, state, sampling, candidate)
    tree, proposal = propose(config, proposer_params, model, state, sampling)
    logits, cache, block = verify(config, model, tree, state.cache)
    return accept_and_commit(config, state, tree, logits, cache, block, proposal, sampling)


# ----------------------------------------------------------------------------- jitted programs


@functools.partial(jax.jit, static_argnames=("config",))
def start(
    params,
    proposer_params,
    cache: KVCache,
    prompt_tokens,
    prompt_lengths,
    last_logits,
    sampling: SamplingParams,
    key,
    stop: StopRule,
    policy_setup=None,
    *,
    config: LoopConfig,
) -> LoopState:
    """The loop's initial state from the prefill, all but its cache (`started` puts that in): the
    first token picked from its logits float32[B, V], and the proposer's state filled from the
    prompts (int32[B, prompt bucket]). The cache is read here (a proposer's init may read it),
    neither changed nor returned: passed through, it would be donated to this call and come back
    from it array by array (60 arrays for SmolLM2), host work at each end of every request's call.
    policy_setup float32[4, K] (an adaptive proposer's): each candidate's seconds per round and what
    earlier requests kept (tokens per round, NaN where none; retry wait; rounds of evidence), set
    into the policy here (policy.with_costs_and_memory) rather than by a call of its own before the
    loop's (acceptance_memory.policy_setup builds it)."""
    model = nnx.merge(config.graphdef, params)
    b = prompt_tokens.shape[0]
    first = pick_token(jax.random.fold_in(key, 0), last_logits, sampling)
    proposal = config.proposer.init(proposer_params, model, cache, prompt_tokens, prompt_lengths, first)
    if policy_setup is not None:
        seconds, tokens, wait, rounds = policy_setup
        policy = with_costs_and_memory(proposal.policy, seconds, tokens, wait.astype(jnp.int32), rounds)
        proposal = proposal.replace(policy=policy)
    return LoopState(
        cache=None,
        proposal=proposal,
        roots=first,
        out=jnp.zeros((b, config.new_bucket + config.depth + 1), jnp.int32).at[:, 0].set(first),
        n_new=jnp.ones((b,), jnp.int32),
        done=stop.is_eos(first) | (stop.max_new_tokens <= 1),
        key=key,
        rounds=jnp.zeros((), jnp.int32),
        active_rounds=jnp.zeros((b,), jnp.int32),
        stop=stop,
    )


def started(run_start, *start_args) -> LoopState:
    """The loop's initial state: `start` (or its compiled program run_start) on start_args, with
    the cache they hold put in on the host. Works on shapes too (jax.eval_shape's run_start)."""
    return run_start(*start_args).replace(cache=start_args[2])


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("state",))
def decode(
    params, proposer_params, state: LoopState, stop_at, sampling: SamplingParams, candidate=-1, *, config: LoopConfig
):
    """Rounds until every sequence is done or `rounds` reaches stop_at (int32[]; the host driver
    raises it chunk by chunk). -> the state.

    With an adaptive proposer the policy picks each round's candidate on the device (policy.choose),
    or candidate (int32[]) >= 0 forces that one (the calibration times each candidate so). The loop
    runs one candidate's rounds back to back in an inner loop until the pick changes: a branch per
    switch, not per round."""

    def more(s):
        return (s.rounds < stop_at) & ~jnp.all(s.done)

    sampled = jnp.logical_not(sampling.greedy)

    if not isinstance(config.proposer, Adaptive):

        def body(s):
            # Merged inside the body so the parameters are loop inputs, not constants.
            return run_round(config, params, proposer_params, s, sampling)

        return jax.lax.while_loop(more, body, state)

    def pick(s):
        return jnp.where(candidate >= 0, candidate, choose(s.proposal.policy, sampled=sampled)).astype(jnp.int32)

    def caught_up(ran, k: int):
        """The sources that sat out a run of candidate k's rounds, brought up to date from the output."""
        model = nnx.merge(config.graphdef, params)
        sources = tuple(
            src.catch_up(proposer_params[j], model, state_j, ran.out, ran.n_new, ran.cache.lengths)
            if config.proposer.waits_out(j, k)
            else state_j
            for j, (src, state_j) in enumerate(zip(config.proposer.sources, ran.proposal.sources))
        )
        return ran.replace(proposal=ran.proposal.replace(sources=sources))

    def rounds_of(k: int):
        def run(s):
            ran = jax.lax.while_loop(
                lambda s: more(s) & (pick(s) == k),
                lambda s: run_round(config, params, proposer_params, s, sampling, k),
                s,
            )
            policy = count_rounds(
                ran.proposal.policy,
                jnp.int32(k),
                ran.rounds - s.rounds,
                (ran.n_new - s.n_new).sum(),
                (ran.active_rounds - s.active_rounds).sum(),
            )
            return caught_up(ran.replace(proposal=ran.proposal.replace(policy=policy)), k)

        return run

    def ar_rounds(s):
        # AR rounds leave the policy's estimates alone, so the rounds until its pick changes are
        # known on entry: run them without consulting it, then record them at once.
        n = jnp.where(candidate >= 0, stop_at, ar_rounds_before_a_retry(s.proposal.policy, sampled))
        until = s.rounds + jnp.minimum(n, stop_at - s.rounds)
        ran = jax.lax.while_loop(
            lambda t: more(t) & (t.rounds < until),
            lambda t: run_round(config, params, proposer_params, t, sampling, AR),
            s,
        )
        policy = record_ar_rounds(
            ran.proposal.policy,
            ran.rounds - s.rounds,
            (ran.n_new - s.n_new).sum(),
            (ran.active_rounds - s.active_rounds).sum(),
            sampled,
        )
        return caught_up(ran.replace(proposal=ran.proposal.replace(policy=policy)), AR)

    branches = [ar_rounds if k == AR else rounds_of(k) for k in range(len(config.proposer.candidates))]

    def one_run(s):  # the rounds of one candidate until the pick changes; counted for the stats
        s = jax.lax.switch(pick(s), branches, s)
        policy = s.proposal.policy
        return s.replace(proposal=s.proposal.replace(policy=policy.replace(candidate_runs=policy.candidate_runs + 1)))

    return jax.lax.while_loop(more, one_run, state)
