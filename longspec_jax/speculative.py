"""Speculative decoding after prefill ("longspec" and "pld"): one jitted `lax.while_loop` of rounds.

A round, for every sequence of the batch at once (SPEC.md 5):
  1. propose a tree rooted at the last emitted token (the root is not in the target cache yet):
     - "longspec": draft step 0 over the tokens emitted last round (padded to D + 1, committed to
       the draft's ring; cross-attention lag 1), then the beam levels 1..D-1 (tree.py), each level
       in the draft's tree slots, seeing its ancestors and the target prefix [0, root position);
     - "pld": the chain that followed the last n-gram's most recent earlier occurrence (pld.py);
  2. verify: one target `forward_block` over the N tree nodes at positions root position + depth
     under the tree mask (hybrid tree attention), writing their K/V after the cache end;
  3. accept (acceptance.py: greedy, or exact sampling from `sampling.filtered_log_probs`) and cut
     at the first EOS / at max_new_tokens;
  4. commit: the root and the kept nodes move into place at the cache end (model.commit); the last
     kept token is the next root and, with the others kept, the next round's draft step 0 input.
Finished sequences still ride along through the forwards (static shapes) but keep nothing.

`history` int32[B, prompt bucket + output bucket + N] holds each prompt followed by its generated
tokens; a token's index there is its position. The first generated token comes from prefill.
generation.py calls `run(generator, prompts, request)`.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from longspec_jax.acceptance import Acceptance, accept_greedy, accept_sampling
from longspec_jax.draft import draft_prefill, draft_step, init_draft_state
from longspec_jax.errors import UserError
from longspec_jax.generation import (
    GenerationResult,
    StopRule,
    cache_bytes,
    compiled,
    finish_tokens,
    make_stats,
    plan_lengths,
    prompt_batch,
    timed,
)
from longspec_jax.model import KVCache, Transformer, commit
from longspec_jax.pld import propose_chain
from longspec_jax.sampling import SamplingParams, filtered_log_probs, pick_token
from longspec_jax.tree import (
    DEFAULT_WIDTHS,
    Tree,
    chain_tree,
    expand_level,
    init_tree,
    level_block,
    level_slice,
    node_depths,
    num_nodes,
    validate_widths,
)

PLD_DEFAULT_TOKENS = 10  # candidates per PLD round (HF's prompt_lookup_num_tokens default)
PLD_MAX_NGRAM, PLD_MIN_NGRAM = 3, 1


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """Static settings of the loop: one compiled program per distinct value.

    tree_widths: the tree's level widths ("pld": the chain (1,) * candidates); new_bucket: the
    output buffer length (>= max_new_tokens)."""

    mode: str
    tree_widths: tuple[int, ...]
    new_bucket: int
    attn_impl: str

    @property
    def depth(self) -> int:
        return len(self.tree_widths)


@dataclasses.dataclass(frozen=True)
class BlockDrafter:
    """The LongSpec draft block behind the three calls the loop makes; static (hashable). Its
    parameters travel separately as a jit argument (`params`, from nnx.split of the block).
    Another drafter (a test oracle) needs the same three methods and `tree_slots` (>= the nodes of
    all levels but the last: the loop passes slot masks of that width)."""

    graphdef: Any
    tree_slots: int

    def init_state(self, params, batch: int):
        return init_draft_state(nnx.merge(self.graphdef, params), batch, tree_slots=self.tree_slots)

    def prefill(self, params, target_model, state, tokens, lengths):
        return draft_prefill(nnx.merge(self.graphdef, params), target_model, state, tokens, lengths)

    def step(self, params, target_model, state, *args, **kwargs):
        return draft_step(nnx.merge(self.graphdef, params), target_model, state, *args, **kwargs)


@struct.dataclass
class SpecState:
    """The loop's carry. n_new int32[B]: tokens generated so far (the last one is the root);
    n_pending int32[B]: how many of them the draft has not seen (its next step 0 input);
    rounds: target forwards so far; emitted / active_rounds: tokens kept by rounds and
    sequence-rounds run while not done, summed over the batch (tau = emitted / active_rounds)."""

    cache: KVCache
    draft_state: Any
    history: jax.Array
    prompt_lengths: jax.Array
    n_new: jax.Array
    n_pending: jax.Array
    done: jax.Array
    key: jax.Array
    rounds: jax.Array
    emitted: jax.Array
    active_rounds: jax.Array
    stop: StopRule

    def roots(self) -> jax.Array:
        index = self.prompt_lengths + self.n_new - 1
        return jnp.take_along_axis(self.history, index[:, None], axis=1)[:, 0]


def _write_rows(buffer: jax.Array, values: jax.Array, start: jax.Array) -> jax.Array:
    """buffer [B, S] with values [B, T] written at columns [start[b], start[b] + T)."""
    return jax.vmap(lambda row, v, s: jax.lax.dynamic_update_slice(row, v.astype(row.dtype), (s,)))(
        buffer, values, start
    )


# ----------------------------------------------------------------------------- one round


def _propose_pld(state: SpecState, config: LoopConfig) -> Tree:
    chain, _ = propose_chain(
        state.history,
        state.prompt_lengths + state.n_new,
        num_tokens=config.depth,
        max_ngram=PLD_MAX_NGRAM,
        min_ngram=PLD_MIN_NGRAM,
    )
    return chain_tree(state.roots(), chain)


def propose_longspec(drafter, draft_params, model: Transformer, state: SpecState, config: LoopConfig):
    """Draft step 0 then the beam levels -> (tree, draft state)."""
    widths, depth = config.tree_widths, config.depth
    b = state.n_new.shape[0]
    root_pos = state.cache.lengths  # the root's position: the tokens before it are all in the cache
    target_k, target_v = state.cache.k[-1], state.cache.v[-1]
    step = functools.partial(drafter.step, draft_params, model, attn_impl=config.attn_impl)

    # Step 0: the tokens emitted last round, ending with the root, left-aligned in D + 1 rows.
    rows = jnp.arange(depth + 1, dtype=jnp.int32)[None, :]
    valid = rows < state.n_pending[:, None]
    positions = jnp.where(valid, root_pos[:, None] - state.n_pending[:, None] + 1 + rows, root_pos[:, None])
    tokens = jnp.take_along_axis(state.history, positions, axis=1)
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((depth + 1, depth + 1), bool)), (b, depth + 1, depth + 1))
    logits, draft_state = step(
        state.draft_state, tokens, positions, valid, target_k, target_v, positions, causal, commit=True
    )
    root_row = jnp.maximum(state.n_pending - 1, 0)[:, None, None]
    root_logits = jnp.take_along_axis(logits, root_row, axis=1)[:, 0]
    tree = init_tree(state.roots(), jax.nn.log_softmax(root_logits, axis=-1), widths)

    # Levels 1..D-1; node i (flat, i >= 1) lives in draft tree slot i - 1. Level d sees the root
    # through the ring and its ancestors (levels < d) through tree slots.
    for d in range(1, depth):
        start, end = level_slice(widths, d)
        tokens, positions, mask = level_block(tree, d, root_pos)
        w = end - start
        slot_mask = jnp.zeros((b, w, drafter.tree_slots), bool).at[:, :, : start - 1].set(mask[:, :, 1:start])
        logits, draft_state = step(
            draft_state,
            tokens,
            positions,
            jnp.ones((b, w), bool),
            target_k,
            target_v,
            jnp.broadcast_to(root_pos[:, None], (b, w)),
            jnp.broadcast_to(jnp.eye(w, dtype=bool), (b, w, w)),
            commit=False,
            slot_mask=slot_mask,
            tree_offset=start - 1,
        )
        tree = expand_level(tree, d, jax.nn.log_softmax(logits, axis=-1))
    return tree, draft_state


def _propose(drafter, draft_params, model, state: SpecState, config: LoopConfig):
    if config.mode == "pld":
        return _propose_pld(state, config), state.draft_state
    return propose_longspec(drafter, draft_params, model, state, config)


def _verify(model: Transformer, tree: Tree, cache: KVCache, config: LoopConfig):
    positions = cache.lengths[:, None] + jnp.asarray(node_depths(tree.widths))[None, :]
    return model.forward_block(tree.tokens, positions, tree.mask, cache, attn_impl=config.attn_impl)


def _accept(tree: Tree, logits: jax.Array, sampling: SamplingParams, key: jax.Array) -> Acceptance:
    if sampling.greedy:
        return accept_greedy(tree, logits)
    return accept_sampling(tree, filtered_log_probs(logits, sampling), key)


def _keep(acc: Acceptance, state: SpecState, depth: int):
    """How many of this round's emitted tokens each sequence keeps (through the first EOS, up to
    max_new_tokens; 0 once done), and whether it ends here."""
    slots = jnp.arange(depth + 1)[None, :]
    is_eos = state.stop.is_eos(acc.emitted) & (slots < acc.n_emitted[:, None])
    hit_eos = is_eos.any(axis=1)
    through_eos = jnp.where(hit_eos, jnp.argmax(is_eos, axis=1) + 1, acc.n_emitted)
    n_keep = jnp.minimum(through_eos, state.stop.max_new_tokens - state.n_new)
    n_keep = jnp.where(state.done, 0, n_keep).astype(jnp.int32)
    ends = (hit_eos & (through_eos <= n_keep)) | (state.n_new + n_keep >= state.stop.max_new_tokens)
    return n_keep, ends


def _finish_round(state: SpecState, acc: Acceptance, cache: KVCache, draft_state, depth: int) -> SpecState:
    n_keep, ends = _keep(acc, state, depth)
    # The root and the nodes of all kept tokens but the last (the next root) join the cache.
    cache = commit(cache, acc.path, n_keep)
    history = _write_rows(state.history, acc.emitted, state.prompt_lengths + state.n_new)
    return state.replace(
        cache=cache,
        draft_state=draft_state,
        history=history,
        n_new=state.n_new + n_keep,
        n_pending=n_keep,
        done=state.done | ends,
        rounds=state.rounds + 1,
        emitted=state.emitted + n_keep.sum(),
        active_rounds=state.active_rounds + (~state.done).sum(),
    )


def _round(drafter, draft_params, model, state: SpecState, sampling, config: LoopConfig) -> SpecState:
    tree, draft_state = _propose(drafter, draft_params, model, state, config)
    logits, cache = _verify(model, tree, state.cache, config)
    acc = _accept(tree, logits, sampling, jax.random.fold_in(state.key, state.rounds + 1))
    return _finish_round(state, acc, cache, draft_state, config.depth)


# ----------------------------------------------------------------------------- jitted programs


@functools.partial(jax.jit, static_argnames=("graphdef", "drafter", "config"), donate_argnames=("cache",))
def spec_start(
    params,
    draft_params,
    cache,
    prompt_tokens,
    prompt_lengths,
    last_logits,
    sampling,
    key,
    stop,
    *,
    graphdef,
    drafter,
    config: LoopConfig,
) -> SpecState:
    """The loop's initial state: the first token picked from the prefill logits float32[B, V]
    (as AR does), the history buffer, and the draft's state filled from the prompts."""
    model = nnx.merge(graphdef, params)
    b, prompt_bucket = prompt_tokens.shape
    first = pick_token(jax.random.fold_in(key, 0), last_logits, sampling)
    # As long as the cache (which holds prompt, output and tree), so the loop's shapes depend on the
    # cache bucket alone and prompts of any length up to it share one compiled loop.
    history = jnp.zeros((b, cache.max_len), jnp.int32)
    history = _write_rows(history.at[:, :prompt_bucket].set(prompt_tokens), first[:, None], prompt_lengths)
    if drafter is None:
        draft_state = ()
    else:
        draft_state = drafter.prefill(
            draft_params, model, drafter.init_state(draft_params, b), prompt_tokens, prompt_lengths
        )
    zero = jnp.zeros((), jnp.int32)
    return SpecState(
        cache=cache,
        draft_state=draft_state,
        history=history,
        prompt_lengths=prompt_lengths,
        n_new=jnp.ones((b,), jnp.int32),
        n_pending=jnp.ones((b,), jnp.int32),
        done=stop.is_eos(first) | (stop.max_new_tokens <= 1),
        key=key,
        rounds=zero,
        emitted=zero,
        active_rounds=zero,
        stop=stop,
    )


@functools.partial(jax.jit, static_argnames=("graphdef", "drafter", "config"), donate_argnames=("state",))
def spec_decode(
    params, draft_params, state: SpecState, stop_at, sampling, *, graphdef, drafter, config: LoopConfig
) -> SpecState:
    """Rounds until every sequence is done or `rounds` reaches stop_at (int32[]; streaming raises it)."""

    def body(s):
        # Merged inside the body so the parameters are loop inputs, not constants.
        return _round(drafter, draft_params, nnx.merge(graphdef, params), s, sampling, config)

    return jax.lax.while_loop(lambda s: (s.rounds < stop_at) & ~jnp.all(s.done), body, state)


def output_tokens(state: SpecState, new_bucket: int) -> tuple[jax.Array, jax.Array]:
    """(int32[B, new_bucket] generated tokens, valid up to n_new[b]; n_new int32[B])."""
    index = state.prompt_lengths[:, None] + jnp.arange(new_bucket)[None, :]
    return jnp.take_along_axis(state.history, index, axis=1), state.n_new


# ----------------------------------------------------------------------------- profiling
# What a round's three parts cost inside one program, as they do in the loop: each part is its own
# program that repeats the part n times in a fori_loop (n is an argument, so n = 1 and n = repeats
# share one compilation), fed its own outputs, on the loop's final state. Timed as one call each, a
# part would also pay a program launch and a host sync (~1 ms on the H200), which on small targets
# is more than the part itself. The optimization barrier at the top of each repetition ties the
# part's inputs to the loop's carry, so XLA cannot hoist loop-invariant work out of the loop. Each
# program donates the buffers it updates (draft state, target cache, the whole state at
# acceptance), so the multi-GB target cache is updated in place and never copied.


def _zeros_like_shapes(tree):
    return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), tree)


@functools.partial(jax.jit, static_argnames=("graphdef", "drafter", "config"), donate_argnames=("draft_state",))
def _repeat_propose(params, draft_params, state, draft_state, n, *, graphdef, drafter, config):
    """state: the loop's state without its draft state (read only). -> (tree, draft state) of the last repetition."""
    model = nnx.merge(graphdef, params)

    def propose(s, draft_state):
        return _propose(drafter, draft_params, model, s.replace(draft_state=draft_state), config)

    def body(_, carry):
        s, draft_state = jax.lax.optimization_barrier((state, carry[1]))
        return propose(s, draft_state)

    first = _zeros_like_shapes(jax.eval_shape(propose, state, draft_state))
    return jax.lax.fori_loop(0, n, body, (first[0], draft_state))


@functools.partial(jax.jit, static_argnames=("graphdef", "config"), donate_argnames=("cache",))
def _repeat_verify(params, tree, cache, n, *, graphdef, config):
    """-> (logits, cache) of the last repetition (each writes the tree's K/V to the same rows)."""
    model = nnx.merge(graphdef, params)

    def body(_, carry):
        t, c = jax.lax.optimization_barrier((tree, carry[1]))
        return _verify(model, t, c, config)

    logits = _zeros_like_shapes(jax.eval_shape(lambda c: _verify(model, tree, c, config), cache))[0]
    return jax.lax.fori_loop(0, n, body, (logits, cache))


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("state",))
def _repeat_accept(state, tree, logits, sampling, n, *, config):
    """state: holds the verified cache and the proposal's draft state. -> the state after n acceptances."""

    def body(_, s):
        t, lg, s = jax.lax.optimization_barrier((tree, logits, s))
        acc = _accept(t, lg, sampling, jax.random.fold_in(s.key, s.rounds + 1))
        return _finish_round(s, acc, s.cache, s.draft_state, config.depth)

    return jax.lax.fori_loop(0, n, body, state)


def profile_round_parts(
    graphdef, params, drafter, draft_params, state: SpecState, sampling, config: LoopConfig, n: int = 1
):
    """A round as its three programs, each part repeated n times -> ((draft, verify, accept)
    seconds, the next state). With n = 1 the result is the state `spec_decode` reaches after one
    round from `state`. Consumes `state` (its buffers are donated)."""
    reps = jnp.asarray(n, jnp.int32)
    rest = state.replace(draft_state=None)
    (tree, draft_state), draft_s = timed(
        functools.partial(_repeat_propose, graphdef=graphdef, drafter=drafter, config=config),
        params,
        draft_params,
        rest,
        state.draft_state,
        reps,
    )
    (logits, cache), verify_s = timed(
        functools.partial(_repeat_verify, graphdef=graphdef, config=config), params, tree, rest.cache, reps
    )
    state, accept_s = timed(
        functools.partial(_repeat_accept, config=config),
        rest.replace(cache=cache, draft_state=draft_state),
        tree,
        logits,
        sampling,
        reps,
    )
    return (draft_s, verify_s, accept_s), state


def profile_round(
    graphdef, params, drafter, draft_params, state: SpecState, sampling, config: LoopConfig, repeats: int = 16
) -> tuple[dict[str, float], SpecState]:
    """Milliseconds per repetition of a round's draft / verify / accept parts, each repeated
    `repeats` times inside its own program after a one-repetition warm-up (which compiles), and
    their sum. Includes 1/repeats of a launch and host sync per part. -> (times, the state after
    1 + repeats acceptances). Consumes `state`. Meant for the loop's final state: sequences that
    are done keep their lengths, so the cache needs no room for the extra acceptances."""
    _, state = profile_round_parts(graphdef, params, drafter, draft_params, state, sampling, config, n=1)
    seconds, state = profile_round_parts(graphdef, params, drafter, draft_params, state, sampling, config, n=repeats)
    draft_ms, verify_ms, accept_ms = (1e3 * s / repeats for s in seconds)
    parts = {"draft_ms": draft_ms, "verify_ms": verify_ms, "accept_ms": accept_ms}
    parts["parts_sum_ms"] = draft_ms + verify_ms + accept_ms
    return parts, state


# ----------------------------------------------------------------------------- entry


def check_draft(draft, target_config) -> None:
    """The draft must have been built for a target of this shape."""
    fields = ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "rope_theta", "rope_scaling")
    mine = draft.target_config
    bad = [f for f in fields if getattr(mine, f) != getattr(target_config, f)]
    if bad:
        raise UserError(
            f"the draft was made for a different target ({', '.join(f'{f} {getattr(mine, f)} vs {getattr(target_config, f)}' for f in bad)}): "
            "load the draft trained for this target"
        )


def resolve_widths(mode: str, tree_widths, vocab_size: int) -> tuple[int, ...]:
    """The mode's tree widths: longspec defaults to DEFAULT_WIDTHS; pld to a chain of
    PLD_DEFAULT_TOKENS and accepts only chains (all widths 1)."""
    if mode == "pld":
        widths = (1,) * PLD_DEFAULT_TOKENS if tree_widths is None else validate_widths(tree_widths, vocab_size)
        if set(widths) != {1}:
            raise UserError(f"mode 'pld' verifies a chain: tree widths must all be 1 (e.g. 1,1,1,1,1), got {widths}")
        return widths
    return validate_widths(DEFAULT_WIDTHS if tree_widths is None else tree_widths, vocab_size)


def drafter_for(draft, widths) -> tuple[BlockDrafter, Any]:
    """(static drafter, its parameters) for a `Draft` (draft_io.py)."""
    graphdef, params = nnx.split(draft.block)
    return BlockDrafter(graphdef, tree_slots=max(1, sum(widths[:-1]))), params


def run(generator, prompts: list[list[int]], request) -> GenerationResult:
    """generation.py's hook for modes "longspec" and "pld" (prompts and request already checked)."""
    target = generator.target
    widths = resolve_widths(generator.mode, generator.tree_widths, target.config.vocab_size)
    if generator.mode == "longspec":
        if generator.draft is None:
            raise UserError(
                "mode 'longspec' needs a draft: pass draft=load_draft(path, target) (CLI: --draft PATH), or use mode 'pld' / 'ar'"
            )
        check_draft(generator.draft, target.config)
        drafter, draft_params = drafter_for(generator.draft, widths)
    else:
        drafter, draft_params = None, ()
    return run_with_drafter(generator, prompts, request, widths, drafter, draft_params)


def run_with_drafter(generator, prompts, request, widths, drafter, draft_params) -> GenerationResult:
    """`run` with an explicit drafter (None for pld): prefill, the loop, results and stats."""
    prompt_bucket, new_bucket, cache_len = plan_lengths(
        max(map(len, prompts)), request.max_new_tokens, slack=num_nodes(widths)
    )
    batch = prompt_batch(prompts, prompt_bucket)
    last_logits, cache, prefill_s, compile_s = generator.run_prefill(batch, cache_len)
    config = LoopConfig(mode=generator.mode, tree_widths=widths, new_bucket=new_bucket, attn_impl=generator.attn_impl)
    statics = dict(graphdef=generator.graphdef, drafter=drafter, config=config)
    stop = StopRule.create(request.eos_token_ids, request.max_new_tokens)
    key = jax.random.key(request.seed)
    tokens, lengths = jnp.asarray(batch.tokens), jnp.asarray(batch.lengths)
    start_args = (generator.params, draft_params, cache, tokens, lengths, last_logits, request.sampling, key, stop)
    start, c1 = compiled(spec_start, *start_args, **statics)
    state_shape = jax.eval_shape(functools.partial(spec_start, **statics), *start_args)
    no_limit = jnp.asarray(np.iinfo(np.int32).max, jnp.int32)
    decode, c2 = compiled(
        spec_decode, generator.params, draft_params, state_shape, no_limit, request.sampling, **statics
    )
    compile_s += c1 + c2

    t0 = time.perf_counter()
    state = start(*start_args)
    if request.stream is None:
        state = decode(generator.params, draft_params, state, no_limit, request.sampling)
    else:
        rounds_per_chunk = max(1, request.stream_every // (config.depth + 1))  # a round emits <= D + 1 tokens
        while True:
            stop_at = jnp.asarray(int(state.rounds) + rounds_per_chunk, jnp.int32)
            state = decode(generator.params, draft_params, state, stop_at, request.sampling)
            out, n_new, done = jax.device_get((*output_tokens(state, new_bucket), state.done))
            request.stream(finish_tokens(out, n_new, request.eos_token_ids))
            if done.all():
                break
    jax.block_until_ready(state)
    decode_s = time.perf_counter() - t0

    out_tokens = finish_tokens(*jax.device_get(output_tokens(state, new_bucket)), request.eos_token_ids)
    rounds, emitted, active = (int(x) for x in jax.device_get((state.rounds, state.emitted, state.active_rounds)))
    profile = {}
    if request.profile:
        profile, state = profile_round(
            generator.graphdef, generator.params, drafter, draft_params, state, request.sampling, config
        )
        profile["round_in_loop_ms"] = 1e3 * decode_s / max(rounds, 1)
    return GenerationResult(
        tokens=out_tokens,
        stats=make_stats(
            prefill_s=prefill_s,
            decode_s=decode_s,
            tokens=out_tokens,
            rounds=rounds,
            tau=emitted / active if active else 1.0,
            target_cache_bytes=cache_bytes(state.cache),
            draft_cache_bytes=cache_bytes(state.draft_state),
            prompt_tokens=int(batch.lengths.sum()),
            compile_s=compile_s,
            profile=profile,
        ),
    )
