"""What a round of the decode loop costs, and what its parts cost (`profile=True`).

- a round alone: one round as its own program (`one_round`), against a round inside the loop
  (decode time / rounds): the two should match (docs/GPU_NOTES.md), a gap is loop overhead;
- its parts (propose, verify, accept + commit) inside one program each, as they run in the loop:
  each part is its own program that repeats the part n times in a fori_loop (n is an argument, so
  n = 1 and n = repeats share one compilation), fed its own outputs, on the loop's final state.
  Timed as one call each, a part would also pay a program launch and a host sync (~1 ms on the
  H200), which on small targets is more than the part itself. The optimization barrier at the top
  of each repetition ties the part's inputs to the loop's carry, so XLA cannot hoist
  loop-invariant work out of the loop. Each program donates the buffers it updates (proposer
  state, target cache, the whole state at acceptance), so the multi-GB target cache is updated in
  place and never copied.
"""

from __future__ import annotations

import functools
import statistics

import jax
import jax.numpy as jnp
from flax import nnx

from longspec_jax.decode_kit import timed
from longspec_jax.decode_loop import LoopConfig, LoopState, accept_and_commit, propose, run_round, verify


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("state",))
def one_round(params, proposer_params, state: LoopState, sampling, *, config: LoopConfig) -> LoopState:
    """One round as its own program (the cache is donated, as in the loop, so costs compare)."""
    return run_round(config, params, proposer_params, state, sampling)


def _zeros_like_shapes(tree):
    return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), tree)


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("proposal",))
def _repeat_propose(params, proposer_params, state, proposal, sampling, n, *, config):
    """state: the loop's state without its proposer state (read only). -> (tree, proposer state)
    of the last repetition."""
    model = nnx.merge(config.graphdef, params)

    def part(s, proposal):
        return propose(config, proposer_params, model, s.replace(proposal=proposal), sampling)

    def body(_, carry):
        s, proposal = jax.lax.optimization_barrier((state, carry[1]))
        return part(s, proposal)

    first = _zeros_like_shapes(jax.eval_shape(part, state, proposal))
    return jax.lax.fori_loop(0, n, body, (first[0], proposal))


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("cache",))
def _repeat_verify(params, tree, cache, n, *, config):
    """-> (logits, cache, block) of the last repetition (the tree's rows, where verify writes them
    into the cache, go to the same place each time)."""
    model = nnx.merge(config.graphdef, params)

    def body(_, carry):
        t, c = jax.lax.optimization_barrier((tree, carry[1]))
        return verify(config, model, t, c)

    logits, _, block = _zeros_like_shapes(jax.eval_shape(lambda c: verify(config, model, tree, c), cache))
    return jax.lax.fori_loop(0, n, body, (logits, cache, block))


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("state",))
def _repeat_accept(state, tree, logits, block, sampling, n, *, config):
    """state: holds the verified cache and the proposal's state. -> the state after n acceptances."""

    def body(_, s):
        t, lg, blk, s = jax.lax.optimization_barrier((tree, logits, block, s))
        return accept_and_commit(config, s, t, lg, s.cache, blk, s.proposal, sampling)

    return jax.lax.fori_loop(0, n, body, state)


def profile_round_parts(config: LoopConfig, params, proposer_params, state: LoopState, sampling, n: int = 1):
    """A round as its three programs, each part repeated n times -> ((propose, verify, accept)
    seconds, the next state). With n = 1 the result is the state `decode` reaches after one round
    from `state`. Consumes `state` (its buffers are donated)."""
    reps = jnp.asarray(n, jnp.int32)
    rest = state.replace(proposal=None)
    (tree, proposal), propose_s = timed(
        functools.partial(_repeat_propose, config=config), params, proposer_params, rest, state.proposal, sampling, reps
    )
    (logits, cache, block), verify_s = timed(
        functools.partial(_repeat_verify, config=config), params, tree, rest.cache, reps
    )
    state, accept_s = timed(
        functools.partial(_repeat_accept, config=config),
        rest.replace(cache=cache, proposal=proposal),
        tree,
        logits,
        block,
        sampling,
        reps,
    )
    return (propose_s, verify_s, accept_s), state


def profile_round(
    config: LoopConfig, params, proposer_params, state: LoopState, sampling, repeats: int = 16
) -> tuple[dict[str, float], LoopState]:
    """Milliseconds: one round as its own program (median of `repeats` after a warm-up), and per
    repetition of the round's draft (propose) / verify / accept parts, each repeated `repeats`
    times inside its own program after a one-repetition warm-up (which compiles), and their sum.
    The parts include 1/repeats of a launch and host sync each. -> (times, the state after
    2 (1 + repeats) rounds). Consumes `state`. Meant for the loop's final state: sequences that are
    done keep their lengths, so the cache needs no room for the extra rounds."""
    alone = []
    for _ in range(repeats + 1):  # the first run compiles and warms up
        state, seconds = timed(functools.partial(one_round, config=config), params, proposer_params, state, sampling)
        alone.append(seconds)
    _, state = profile_round_parts(config, params, proposer_params, state, sampling, n=1)
    seconds, state = profile_round_parts(config, params, proposer_params, state, sampling, n=repeats)
    draft_ms, verify_ms, accept_ms = (1e3 * s / repeats for s in seconds)
    parts = {
        "step_alone_ms": 1e3 * statistics.median(alone[1:]),
        "draft_ms": draft_ms,
        "verify_ms": verify_ms,
        "accept_ms": accept_ms,
        "parts_sum_ms": draft_ms + verify_ms + accept_ms,
    }
    return parts, state
