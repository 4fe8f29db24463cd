"""Generation: the public API (`generate`, `Generator`) and the host driver, one for every mode.

`generate(target, prompt_ids, mode=...)` is the one entry for "ar", "longspec" and "pld"; a mode
is only a proposer (proposers.py). The driver, the same for all of them:
    prompts -> buckets (decode_kit.plan_lengths) -> prefill -> the loop's start -> the device loop
    (decode_loop.decode) in chunks -> tokens cut after EOS -> result and stats,
with `round_profile` when profile=True. Modules import only downwards:
    decode_kit <- proposers <- decode_loop <- round_profile <- generation.

Static shapes: the prompt is right-padded to a bucket, the output buffer and cache are sized from
buckets, and every length / limit is an array, so one compiled program serves all prompts of a
bucket. Compiled programs are cached per process (decode_kit.compiled), keyed by the graph
definitions and the argument shapes, so a `Generator` (or repeated `generate` calls) compiles once
per bucket. What recompiles: a new prompt bucket (prefill only), a new output bucket or cache size
(the loop), another mode or tree, another attention implementation, turning top-k or top-p
filtering on or off (each a vocabulary sort), and in mode "auto" a change between greedy and
sampling or to a batch of 4 or more (other candidate trees, adaptive.candidate_plan). What does
not: temperature (greedy <-> sampling in the fixed modes), the values of top-k / top-p, seed,
max_new_tokens within its bucket, EOS ids (of one count).

The loop runs in chunks of rounds with a host check in between: `stream_every` tokens' worth when
streaming, else the whole request in one call when it is short (WHOLE_REQUEST_ROUNDS), CHUNK_ROUNDS
when it is long. Ctrl-C between or during chunks raises `GenerationInterrupted` carrying the tokens
made so far. A `Generator` keeps each shape's programs, so a request pays no tracing or hashing.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from longspec_jax import attention
from longspec_jax.acceptance_memory import memory_key, policy_setup, remember, weights_fingerprint, with_remembered
from longspec_jax.adaptive import (
    DEFAULT_LOOKUP_TOKENS,
    Adaptive,
    AdaptiveState,
    adaptive_proposer,
    candidate_plan,
    greedy_deep_tree,
)
from longspec_jax.calibration import calibrated, calibration_key, kept_costs, policy_stats, unmeasured_setup
from longspec_jax.compile_cache import enable_compile_cache
from longspec_jax.decode_kit import (
    GenerationResult,
    GenerationStats,
    PromptBatch,
    StopRule,
    cache_bytes,
    cache_row_bytes,
    check_prompts,
    compiled,
    device_free_bytes,
    fetch,
    finish_tokens,
    make_stats,
    normalize_prompts,
    plan_lengths,
    prefill,
    prompt_batch,
    timed,
)
from longspec_jax.decode_loop import LoopConfig, LoopState, decode, start, started
from longspec_jax.draft_io import inference_draft, sampling_draft_for
from longspec_jax.errors import GenerationInterrupted, UserError
from longspec_jax.proposers import check_lookup_tokens, proposer_for
from longspec_jax.round_profile import profile_round
from longspec_jax.sampling import SamplingParams, SamplingSettings
from longspec_jax.tokenizer import decode as decode_text

__all__ = ["AUTO_MODE", "DEFAULT_MODE", "MODES", "GenerationResult", "GenerationStats", "Generator", "generate"]

MODES = ("longspec", "ar", "pld")
# The mode `generate`, `Generator` and the CLI use when none is given: longspec when a draft is
# given or shipped for the target (the embedded SmolLM2 has one), else ar.
AUTO_MODE = "auto"
DEFAULT_MODE = AUTO_MODE
# Rounds per run of the loop when not streaming. Between runs the host checks whether every sequence
# is done (one sync, well under a millisecond); a round takes a millisecond or more, so the check
# costs under 1 % of decoding, and Ctrl-C waits at most this many rounds.
CHUNK_ROUNDS = 128
# ... unless the whole request fits in this many rounds: then one call runs it all (each call costs
# the host a dispatch and a read, ~1 ms together, which a short request feels).
WHOLE_REQUEST_ROUNDS = 512
SEED_RANGE = (-(2**63), 2**63)  # what jax.random.key takes

StreamCallback = Callable[[list[list[int]]], None]


@dataclasses.dataclass(frozen=True)
class DecodeRequest:
    """What a decode needs besides the model and prompts."""

    max_new_tokens: int
    sampling: SamplingSettings
    seed: int
    eos_token_ids: tuple[int, ...]
    stream: StreamCallback | None = None
    stream_every: int = 32
    profile: bool = False


def check_seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer | float) or int(seed) != seed:
        raise UserError(f"seed must be an integer, got {seed!r}")
    if not SEED_RANGE[0] <= int(seed) < SEED_RANGE[1]:
        raise UserError(f"seed must be an integer in [-2**63, 2**63), got {seed!r}: use a smaller seed")
    return int(seed)


@dataclasses.dataclass(frozen=True)
class _LoopPrograms:
    """A request shape's loop: its config, the compiled `start` and `decode`, the state's shapes,
    the adaptive calibration's key (None for a fixed mode) and what compiling them took."""

    config: LoopConfig
    start: Any
    state_shape: Any
    loop: Any
    calibration_key: str | None
    compile_s: float


@dataclasses.dataclass
class _Progress:
    """What the host has read back of a running decode."""

    out: np.ndarray
    n_new: np.ndarray
    done: np.ndarray
    rounds: int
    emitted: int  # tokens kept by rounds (the first of each sequence comes from prefill)
    active_rounds: int  # sequence-rounds run while not done; tau = emitted / active_rounds
    policy: Any = None  # the adaptive policy's state (adaptive.py), read back as numpy arrays

    @classmethod
    def read(cls, state: LoopState) -> _Progress:
        policy = state.proposal.policy if isinstance(state.proposal, AdaptiveState) else None
        out, n_new, done, rounds, active, policy = fetch(
            (state.out, state.n_new, state.done, state.rounds, state.active_rounds, policy)
        )
        return cls(out, n_new, done, int(rounds), int((n_new - 1).sum()), int(active.sum()), policy)


def stream_rounds(tokens: int, tokens_per_round: float) -> int:
    """Rounds per call of the loop when streaming: about `tokens` new tokens at the tokens per
    round seen so far (each call costs the host a read, so no fewer rounds than that needs)."""
    return max(1, round(tokens / max(tokens_per_round, 1.0)))


class Generator:
    """Load once, generate many times: compiled programs are reused for every prompt of a bucket.

    >>> gen = Generator(load_target(None))
    >>> gen.generate("The capital of France is", max_new_tokens=20).text[0]

    `proposer` / `proposer_params` (proposers.py) are what the mode proposes each round.
    """

    def __init__(
        self,
        target,
        draft=None,
        *,
        sampling_draft=None,
        mode: str = DEFAULT_MODE,
        attn_impl: str | None = None,
        tree_widths=None,
        lookup_tokens: int | None = None,
    ):
        """draft: the LongSpec draft (default: the one shipped for the target, if any);
        sampling_draft: the one for requests that sample (default: `draft` when one is given, else
        the target's shipped sampling draft, else the shipped draft); lookup_tokens: a prompt-lookup
        chain of that many tokens beside the draft's tree, verified with it (mode "longspec": none
        unless given; mode "auto": beside its trees when greedy below a batch of 4, by default
        adaptive.DEFAULT_LOOKUP_TOKENS when there is a draft; 0: none)."""
        if mode not in (*MODES, AUTO_MODE):
            raise UserError(f"unknown mode {mode!r}: choose one of {', '.join((*MODES, AUTO_MODE))}")
        if mode in ("longspec", AUTO_MODE):
            sampling_draft = sampling_draft_for(target, draft, sampling_draft)
            if draft is None:
                draft = inference_draft(target)  # the shipped one, if any
        if mode == AUTO_MODE and tree_widths is not None:
            mode = "longspec"  # a fixed tree was asked for
        self.target = target
        self.draft = draft
        self.sampling_draft = sampling_draft if mode in ("longspec", AUTO_MODE) else None
        self.mode = mode
        self.attn_impl = attention.default_impl() if attn_impl is None else attn_impl
        self.tree_widths = None if tree_widths is None else tuple(int(w) for w in tree_widths)
        if lookup_tokens is None:
            lookup_tokens = DEFAULT_LOOKUP_TOKENS if mode == AUTO_MODE and draft is not None else 0
        self.lookup_tokens = int(lookup_tokens)
        if mode == AUTO_MODE and self.lookup_tokens:  # the chain goes beside its greedy trees
            check_lookup_tokens("longspec", greedy_deep_tree(self.lookup_tokens), self.lookup_tokens)
            if draft is None:
                raise UserError(
                    "lookup_tokens puts a prompt-lookup chain beside a draft's tree, and this target has no shipped "
                    "draft: pass a draft (CLI: --draft PATH), or use mode 'pld'"
                )
        enable_compile_cache()
        self.graphdef, state = nnx.split(target.decode_model())
        # Plain nested dicts: every call of a compiled program flattens its arguments, and a State's
        # Variable nodes cost the host ~1-2 us each to flatten (0.2-0.4 ms for SmolLM2's 182 arrays).
        self.params = nnx.to_pure_dict(state)
        self._proposers: dict[tuple, tuple] = {}  # (plan or mode, sampled) -> (proposer, parameters)
        self._fingerprints: dict[bool, str] = {}  # of the weights, for mode auto's acceptance memory
        self._memory_keys: dict[tuple, str] = {}  # acceptance_key's answers
        self._programs: dict[tuple, Any] = {}  # compiled programs by shape (loop_programs, run_prefill)
        self._sampling: dict[SamplingSettings, SamplingParams] = {}
        if mode == AUTO_MODE:
            self.proposer, self.proposer_params = None, None  # chosen per request (adaptive.py)
        else:  # the mode's with `draft`, built now so that a missing draft is an error before any request
            self.proposer, self.proposer_params = proposer_for(
                mode, target, draft, self.tree_widths, lookup_tokens=self.lookup_tokens
            )

    def draft_for(self, sampling: SamplingSettings):
        """The draft a request with these sampling settings decodes with (None: none)."""
        return self.draft if sampling.greedy else self.sampling_draft

    def proposer_for_request(self, request: DecodeRequest, batch: int):
        """(proposer, its parameters): the mode's with the request's draft, or for mode "auto" the
        adaptive set that fits the request's sampling and batch size (built once per plan)."""
        draft = self.draft_for(request.sampling)
        if self.proposer is not None:
            if draft is self.draft:
                return self.proposer, self.proposer_params
            if (self.mode, True) not in self._proposers:
                self._proposers[(self.mode, True)] = proposer_for(
                    self.mode, self.target, draft, self.tree_widths, lookup_tokens=self.lookup_tokens
                )
            return self._proposers[(self.mode, True)]
        sampled = not request.sampling.greedy
        plan = candidate_plan(draft is not None, request.sampling.greedy, batch, self.lookup_tokens)
        if (plan, sampled) not in self._proposers:
            self._proposers[(plan, sampled)] = adaptive_proposer(self.target, draft, plan)
        return self._proposers[(plan, sampled)]

    def acceptance_key(self, proposer: Adaptive, request: DecodeRequest, batch: int) -> str:
        """The key of what mode auto's candidates kept in earlier requests of this kind
        (acceptance_memory.py): the target's and draft's weights, the candidates, the batch size,
        the sampling settings (worked out once per kind: hashing it is host time every request)."""
        kind = (proposer.names, batch, request.sampling)
        if kind not in self._memory_keys:
            draft = self.draft_for(request.sampling)
            sampled = not request.sampling.greedy
            if sampled not in self._fingerprints:
                self._fingerprints[sampled] = weights_fingerprint(
                    (self.params, None if draft is None else nnx.state(draft.block))
                )
            vocabulary = None if draft is None else draft.proposal_key()
            self._memory_keys[kind] = memory_key(
                weights=self._fingerprints[sampled],
                draft_vocabulary=vocabulary,
                candidates=proposer.names,
                batch=batch,
                **dataclasses.asdict(request.sampling),
            )
        return self._memory_keys[kind]

    def generate(
        self,
        prompt,
        *,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
        chat: bool = False,
        eos_token_ids: Sequence[int] | None = None,
        stream: StreamCallback | None = None,
        stream_every: int = 32,
        profile: bool = False,
    ) -> GenerationResult:
        """prompt: text, token ids, or a list of either (a batch). eos_token_ids defaults to the
        target config's. stream(tokens_so_far) is called about every `stream_every` tokens (a
        speculative mode's calls hold the rounds that many tokens took so far, `stream_rounds`).
        profile=True adds per-round timings to stats.profile. Ctrl-C raises
        `GenerationInterrupted` (a KeyboardInterrupt) whose `result` holds the tokens so far."""
        prompts = normalize_prompts(prompt, self.target.tokenizer, chat=chat)
        check_prompts(prompts, self.target.config, max_new_tokens)
        request = DecodeRequest(
            max_new_tokens=int(max_new_tokens),
            sampling=SamplingSettings.checked(temperature, top_k=top_k, top_p=top_p),
            seed=check_seed(seed),
            eos_token_ids=tuple(self.target.config.eos_token_ids if eos_token_ids is None else eos_token_ids),
            stream=stream,
            stream_every=max(1, int(stream_every)),
            profile=profile,
        )
        return self.decode(prompts, request)

    def sampling_params(self, settings: SamplingSettings) -> SamplingParams:
        """The loop's sampling arrays for these settings, made once per Generator and settings (a
        request with the settings of an earlier one sends nothing to the device for them)."""
        if settings not in self._sampling:
            self._sampling[settings] = settings.params()
        return self._sampling[settings]

    def run_prefill(self, batch: PromptBatch, cache_len: int):
        """-> (last_logits, cache, seconds, compile seconds)."""
        args = (self.params, jnp.asarray(batch.tokens), jnp.asarray(batch.lengths))
        key = ("prefill", batch.tokens.shape, cache_len)
        compile_s = 0.0
        if key not in self._programs:
            self._programs[key], compile_s = compiled(
                prefill, *args, graphdef=self.graphdef, max_len=cache_len, attn_impl=self.attn_impl
            )
        (last_logits, cache), seconds = timed(self._programs[key], *args)
        return last_logits, cache, seconds, compile_s

    def loop_programs(
        self, proposer, proposer_params, new_bucket: int, cache_len: int, start_args, draft
    ) -> _LoopPrograms:
        """The loop's programs for these shapes, built once per Generator and shape: keying the
        process-wide compile cache hashes the graph definitions and tracing `start` for its
        output's shapes takes milliseconds of host time, which a request should not pay again."""
        rest = start_args[2:]  # the model's and the proposer's parameters keep their shapes
        key = (
            id(proposer),
            new_bucket,
            jax.tree.structure(rest),
            tuple((x.shape, x.dtype) for x in jax.tree.leaves(rest)),
        )
        if key in self._programs:
            return dataclasses.replace(self._programs[key], compile_s=0.0)
        config = LoopConfig(self.graphdef, proposer, new_bucket, self.attn_impl)
        run_start, c1 = compiled(start, *start_args, config=config)
        # The state's shapes, the cache's as shapes too (its arrays would stay alive in this cache).
        cache_shape = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), start_args[2])
        state_shape = jax.eval_shape(functools.partial(start, config=config), *start_args).replace(cache=cache_shape)
        rounds_limit = jnp.asarray(0, jnp.int32)
        policy_picks = jnp.asarray(-1, jnp.int32)  # adaptive: the policy picks each round's candidate
        sampling = start_args[6]
        loop, c2 = compiled(
            decode, self.params, proposer_params, state_shape, rounds_limit, sampling, policy_picks, config=config
        )
        calibration = None
        if isinstance(proposer, Adaptive):
            calibration = calibration_key(
                target=repr(self.target.config),
                dtype=str(self.target.dtype),
                draft=None if draft is None else repr(draft.config),
                draft_vocabulary=None if draft is None else draft.proposal_key(),
                batch=start_args[3].shape[0],
                cache_rows=cache_len,
                new_bucket=new_bucket,
                candidates=proposer.names,
                attn_impl=self.attn_impl,
                filters=(sampling.use_top_k, sampling.use_top_p),
            )
        self._programs[key] = _LoopPrograms(config, run_start, state_shape, loop, calibration, c1 + c2)
        return self._programs[key]

    def plan(self, longest_prompt: int, batch: int, request: DecodeRequest):
        """(proposer, its parameters, (prompt bucket, output bucket, cache rows)) of a request of
        `batch` prompts, the longest of `longest_prompt` tokens: `plan_lengths` with the proposer's
        slack, the cache's bytes and the device's free memory, as `decode` runs it. The cache rows
        decide which compiled loop the request runs."""
        proposer, proposer_params = self.proposer_for_request(request, batch)
        slack = proposer.slack if isinstance(proposer, Adaptive) else sum(proposer.widths)
        lengths = plan_lengths(
            longest_prompt,
            request.max_new_tokens,
            slack=slack,
            row_bytes=cache_row_bytes(self.target.config, batch, self.target.dtype),
            free_bytes=device_free_bytes(),
        )
        return proposer, proposer_params, lengths

    def cache_rows(self, longest_prompt: int, batch: int, *, max_new_tokens: int, temperature: float = 0.0) -> int:
        """The cache rows (the decode loop's shape) a greedy or sampled request would run with now."""
        request = DecodeRequest(
            max_new_tokens=int(max_new_tokens),
            sampling=SamplingSettings.checked(temperature),
            seed=0,
            eos_token_ids=(),
        )
        return self.plan(longest_prompt, batch, request)[2][2]

    def decode(self, prompts: list[list[int]], request: DecodeRequest) -> GenerationResult:
        """The host driver for checked prompts: prefill, the loop in chunks, the result."""
        proposer, proposer_params, (prompt_bucket, new_bucket, cache_len) = self.plan(
            max(map(len, prompts)), len(prompts), request
        )
        adaptive = isinstance(proposer, Adaptive)
        widths = proposer.widths
        batch = prompt_batch(prompts, prompt_bucket)
        sampling = self.sampling_params(request.sampling)
        last_logits, cache, prefill_s, compile_s = self.run_prefill(batch, cache_len)
        stop = StopRule.create(request.eos_token_ids, request.max_new_tokens)
        start_args = (
            self.params,
            proposer_params,
            cache,
            jnp.asarray(batch.tokens),
            jnp.asarray(batch.lengths),
            last_logits,
            sampling,
            jax.random.key(request.seed),
            stop,
            unmeasured_setup(len(proposer.names)) if adaptive else None,  # replaced below where the costs are kept
        )
        draft = self.draft_for(request.sampling)
        programs = self.loop_programs(proposer, proposer_params, new_bucket, cache_len, start_args, draft)
        state_shape, loop = programs.state_shape, programs.loop
        compile_s += programs.compile_s
        if request.stream is not None:
            chunk = stream_rounds(request.stream_every, 1.0 + len(widths) / 2)
        else:  # every round keeps at least one token of every active sequence
            chunk = request.max_new_tokens if request.max_new_tokens <= WHOLE_REQUEST_ROUNDS else CHUNK_ROUNDS

        def result(progress: _Progress, decode_s: float, profile=None, timeline=None) -> GenerationResult:
            tokens = finish_tokens(progress.out, progress.n_new, request.eos_token_ids)
            stats = make_stats(
                prefill_s=prefill_s,
                decode_s=decode_s,
                tokens=tokens,
                rounds=progress.rounds,
                tau=progress.emitted / progress.active_rounds if progress.active_rounds else 1.0,
                target_cache_bytes=cache_bytes(state_shape.cache),
                draft_cache_bytes=proposer.cache_bytes(state_shape.proposal),
                prompt_tokens=int(batch.lengths.sum()),
                compile_s=compile_s,
                profile=profile,
                policy=policy_stats(proposer, progress.policy, calibration, remembered) if adaptive else {},
                runs=timeline,
            )
            text = None if self.target.tokenizer is None else [decode_text(self.target.tokenizer, t) for t in tokens]
            return GenerationResult(tokens=tokens, stats=stats, text=text)

        def run(state, rounds: int, candidate: int = -1):
            """The loop until `rounds` rounds in all, or every sequence is done (adaptive: every round
            by `candidate` when it is >= 0, else as the policy picks)."""
            limit = jnp.asarray(rounds, jnp.int32)
            return loop(self.params, proposer_params, state, limit, sampling, jnp.asarray(candidate, jnp.int32))

        t0 = time.perf_counter()
        progress = None
        calibration = None
        remembered = ()
        memory = self.acceptance_key(proposer, request, len(prompts)) if adaptive else None
        runs = []  # each call of the loop: (what, rounds, seconds), the host's reads included
        try:
            setup, seconds, sampled = start_args[-1], None, not request.sampling.greedy
            if adaptive:  # costs measured before: they and the memory go into the policy in the start call
                seconds = kept_costs(proposer.names, programs.calibration_key)
                if seconds is not None:
                    setup, remembered = policy_setup(proposer.names, memory, sampled, seconds)
                    calibration = "kept"
            state = started(programs.start, *start_args[:-1], setup)
            rounds = 0  # the host reads the state only after a loop call: no sync before the loop
            if adaptive and seconds is None:  # measured now, on the first rounds, then set
                state, seconds, calibration = calibrated(state, run, proposer.names, programs.calibration_key)
                rounds = int(state.rounds) if calibration == "measured" else 0
                state, remembered = with_remembered(state, proposer.names, memory, sampled, seconds=seconds)
            if request.profile:
                jax.block_until_ready(state)
                runs.append(("start", rounds, time.perf_counter() - t0))
            while progress is None or not progress.done.all():
                called = time.perf_counter()
                state = run(state, rounds + chunk)
                progress = _Progress.read(state)
                runs.append(("loop", progress.rounds - rounds, time.perf_counter() - called))
                rounds = progress.rounds
                if request.stream is not None:
                    chunk = stream_rounds(request.stream_every, progress.emitted / max(progress.active_rounds, 1))
                    request.stream(finish_tokens(progress.out, progress.n_new, request.eos_token_ids))
        except KeyboardInterrupt as interrupt:
            partial = None if progress is None else result(progress, time.perf_counter() - t0)
            raise GenerationInterrupted(partial) from interrupt
        decode_s = time.perf_counter() - t0
        if adaptive:
            remember(memory, proposer.names, progress.policy)

        profile = {}
        if request.profile and not adaptive:  # adaptive: each candidate's round time is in stats.policy
            profile, state = profile_round(programs.config, self.params, proposer_params, state, sampling)
        if request.profile:
            profile["step_in_loop_ms"] = 1e3 * decode_s / max(progress.rounds, 1)
        timeline = [{"what": name, "rounds": n, "ms": 1e3 * s} for name, n, s in runs]
        return result(progress, decode_s, profile, timeline)


def generate(
    target,
    prompt_ids,
    *,
    mode: str = DEFAULT_MODE,
    draft=None,
    sampling_draft=None,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    attn_impl: str | None = None,
    tree_widths=None,
    lookup_tokens: int | None = None,
    eos_token_ids: Sequence[int] | None = None,
    stream: StreamCallback | None = None,
    stream_every: int = 32,
    profile: bool = False,
) -> GenerationResult:
    """Generate from a target: prompt_ids is list[int] (one prompt) or list[list[int]] (a batch;
    lengths may differ), or text when the target has a tokenizer. See `Generator` and `Generator.generate`."""
    generator = Generator(
        target,
        draft,
        sampling_draft=sampling_draft,
        mode=mode,
        attn_impl=attn_impl,
        tree_widths=tree_widths,
        lookup_tokens=lookup_tokens,
    )
    return generator.generate(
        prompt_ids,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        eos_token_ids=eos_token_ids,
        stream=stream,
        stream_every=stream_every,
        profile=profile,
    )
