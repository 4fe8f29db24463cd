"""Generation: the public `generate` entry, the `Generator` object API and plain AR decoding.

`generate(target, prompt_ids, mode=...)` is the one entry for every mode. "ar" lives here; the
speculative modes ("longspec", "pld") live in `speculative.py`, which must provide

    run(generator: Generator, prompts: list[list[int]], request: DecodeRequest) -> GenerationResult

and reuses the shared pieces below: `prompt_batch` / `plan_lengths` (right-padded, bucketed
shapes), `prefill` (jitted; parameters are arguments), `compiled` (compile once per shape, time
compilation apart from running), `StopRule` (EOS / max_new_tokens on device), `finish_tokens`
(truncation at EOS), `GenerationStats` / `GenerationResult`.

Static shapes: the prompt is right-padded to a bucket, the output buffer and cache are sized from
buckets, and every length / limit is an array, so one compiled program serves all prompts of a
bucket and changing temperature, top-p, top-k, seed or max_new_tokens inside a bucket does not
recompile. Compiled programs are cached per process, keyed by the model's graph definition and the
argument shapes, so a `Generator` (or repeated `generate` calls) compile once per bucket.

AR decoding: prefill picks the first token; then ONE jitted `lax.while_loop` runs forward_block
(T = 1) + commit + pick per step until every sequence has hit EOS or produced exactly
max_new_tokens. With a `stream` callback the same loop runs in chunks of `stream_every` tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from longspec_jax import attention
from longspec_jax.errors import UserError
from longspec_jax.model import KVCache, commit, init_cache
from longspec_jax.sampling import SamplingParams, pick_token
from longspec_jax.tokenizer import decode, encode_prompt

MODES = ("longspec", "ar", "pld")
# The mode `generate`, `Generator` and the CLI use when none is given: longspec when a draft is
# given or shipped for the target (the embedded SmolLM2 has one), else ar.
AUTO_MODE = "auto"
DEFAULT_MODE = AUTO_MODE
PAD_TOKEN = -1  # fills the output buffer after a sequence stops; never returned
SMALL_BUCKETS_UP_TO = 256  # up to this, lengths round up to a power of two (>= 16); above, see bucket_length

StreamCallback = Callable[[list[list[int]]], None]


# ----------------------------------------------------------------------------- results


@dataclasses.dataclass
class GenerationStats:
    """Timings and counts of one generate call. tokens_per_s = new_tokens / decode_s (all
    sequences together; the first token of each comes out of prefill). tau = mean tokens emitted
    per target forward after prefill (1 for AR); rounds = target forwards after prefill."""

    prefill_s: float
    decode_s: float
    new_tokens: int
    tokens_per_s: float
    tau: float
    rounds: int
    draft_cache_bytes: int
    target_cache_bytes: int
    prompt_tokens: int = 0
    compile_s: float = 0.0
    profile: dict[str, float] = dataclasses.field(default_factory=dict)

    def line(self) -> str:
        """One human-readable summary line."""
        text = (
            f"{self.new_tokens} new tokens in {self.decode_s:.2f} s ({self.tokens_per_s:.1f} tok/s) | "
            f"prefill {self.prompt_tokens} tokens {self.prefill_s:.2f} s | tau {self.tau:.2f} over "
            f"{self.rounds} rounds | cache target {_mib(self.target_cache_bytes)}, draft "
            f"{_mib(self.draft_cache_bytes)}"
        )
        if self.compile_s:
            text += f" | compile {self.compile_s:.1f} s"
        return text

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class GenerationResult:
    """tokens: the new tokens per sequence, truncated after the first EOS (kept, as HF does);
    text: their decoding (special tokens skipped) when the target has a tokenizer."""

    tokens: list[list[int]]
    stats: GenerationStats
    text: list[str] | None = None


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def cache_bytes(tree) -> int:
    """Bytes held by all arrays of a pytree (a KV cache, a draft state)."""
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


# ----------------------------------------------------------------------------- shared pieces


@dataclasses.dataclass(frozen=True)
class DecodeRequest:
    """What a mode's decode needs besides the model and prompts."""

    max_new_tokens: int
    sampling: SamplingParams
    seed: int
    eos_token_ids: tuple[int, ...]
    stream: StreamCallback | None = None
    stream_every: int = 32
    profile: bool = False


@struct.dataclass
class StopRule:
    """When a sequence stops, as arrays (no recompiles): eos_ids int32[E], max_new_tokens int32[]."""

    eos_ids: jax.Array
    max_new_tokens: jax.Array

    @classmethod
    def create(cls, eos_token_ids: Sequence[int], max_new_tokens: int) -> StopRule:
        ids = list(eos_token_ids) or [PAD_TOKEN]  # PAD_TOKEN never matches a real token
        return cls(jnp.asarray(ids, jnp.int32), jnp.asarray(max_new_tokens, jnp.int32))

    def is_eos(self, tokens: jax.Array) -> jax.Array:
        """bool of tokens' shape."""
        return jnp.any(tokens[..., None] == self.eos_ids, axis=-1)


@dataclasses.dataclass(frozen=True)
class PromptBatch:
    """Right-padded prompts: tokens int32[B, L_bucket] (padding 0), lengths int32[B]."""

    tokens: np.ndarray
    lengths: np.ndarray


def bucket_length(n: int) -> int:
    """The padded size for a length n: a power of two >= 16 up to 256, then quarter-octave steps
    (256 < n <= 512: multiples of 64; 512 < n <= 1024: of 128; ...), so padding stays under 25 %
    while a 2k-8k range holds only 12 buckets (one prefill compilation each)."""
    if n <= SMALL_BUCKETS_UP_TO:
        return max(16, 1 << (max(n, 1) - 1).bit_length())
    step = (1 << (n - 1).bit_length()) // 8
    return -(-n // step) * step


def plan_lengths(longest_prompt: int, max_new_tokens: int, *, slack: int = 0) -> tuple[int, int, int]:
    """(prompt bucket, output bucket, cache rows). `slack`: extra cache rows a mode writes past the
    last kept token (e.g. a speculative tree).

    The cache rows are a power of two: the decode loop's shapes depend on them alone, so prompts
    from 2k to 4k tokens (say) share one compiled loop and only the cheap prefill compiles per
    prompt bucket. The Pallas and cuDNN kernels read only the rows in use, so a roomier cache
    costs no time on GPU."""
    prompt_bucket = bucket_length(longest_prompt)
    new_bucket = bucket_length(max_new_tokens)
    return prompt_bucket, new_bucket, 1 << (prompt_bucket + new_bucket + slack - 1).bit_length()


def prompt_batch(prompts: list[list[int]], prompt_bucket: int) -> PromptBatch:
    """Right-pad validated prompts to [B, prompt_bucket]."""
    tokens = np.zeros((len(prompts), prompt_bucket), np.int32)
    for row, ids in zip(tokens, prompts):
        row[: len(ids)] = ids
    return PromptBatch(tokens, np.asarray([len(p) for p in prompts], np.int32))


def normalize_prompts(prompt, tokenizer=None, *, chat: bool = False) -> list[list[int]]:
    """str | list[str] | list[int] | list[list[int]] (or int arrays) -> list of token-id lists."""
    if isinstance(prompt, np.ndarray | jax.Array):
        prompt = np.asarray(prompt).tolist()
    if isinstance(prompt, str):
        prompt = [prompt]
    if not isinstance(prompt, Sequence) or len(prompt) == 0:
        raise UserError("empty prompt: pass at least one token (or non-empty text)")
    if all(isinstance(t, int | np.integer) for t in prompt):
        prompt = [prompt]
    if tokenizer is None and any(isinstance(p, str) for p in prompt):
        raise UserError(
            "this target has no tokenizer: pass token ids instead of text, or load a checkpoint with a tokenizer"
        )
    prompts = []
    for p in prompt:
        ids = encode_prompt(tokenizer, p, chat=chat) if isinstance(p, str) else [int(t) for t in p]
        if not ids:
            raise UserError("empty prompt: every prompt needs at least one token")
        prompts.append(ids)
    return prompts


def check_prompts(prompts: list[list[int]], config, max_new_tokens: int) -> None:
    """Token ids in range and prompt + max_new_tokens inside the context window."""
    if int(max_new_tokens) != max_new_tokens or max_new_tokens < 1:
        raise UserError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens}")
    for ids in prompts:
        bad = [t for t in ids if not 0 <= t < config.vocab_size]
        if bad:
            raise UserError(
                f"token id {bad[0]} is outside the target's vocabulary [0, {config.vocab_size}): check the tokenizer"
            )
    longest = max(len(p) for p in prompts)
    window = config.max_position_embeddings
    if longest + max_new_tokens > window:
        raise UserError(
            f"prompt has {longest} tokens; with max_new_tokens={max_new_tokens} that needs "
            f"{longest + max_new_tokens} positions but the target's context window is {window}: shorten "
            f"the prompt to at most {max(window - max_new_tokens, 0)} tokens or lower max_new_tokens"
        )


def finish_tokens(out: np.ndarray, num_tokens: np.ndarray, eos_token_ids: Sequence[int]) -> list[list[int]]:
    """out int[B, N] with num_tokens[b] valid entries -> per-sequence lists cut after the first EOS."""
    eos = set(eos_token_ids)
    result = []
    for row, n in zip(np.asarray(out), np.asarray(num_tokens)):
        ids = [int(t) for t in row[: int(n)]]
        cut = next((i + 1 for i, t in enumerate(ids) if t in eos), len(ids))
        result.append(ids[:cut])
    return result


_COMPILED: dict[tuple, Any] = {}


def compiled(jitted, *args, **static) -> tuple[Any, float]:
    """(executable, seconds spent compiling) of a `jax.jit` function for these arguments' shapes
    (arrays or ShapeDtypeStructs) and static keyword values; compiled at most once per process."""
    leaves, treedef = jax.tree.flatten(args)
    key = (jitted, treedef, tuple((tuple(x.shape), str(x.dtype)) for x in leaves), tuple(sorted(static.items())))
    if key in _COMPILED:
        return _COMPILED[key], 0.0
    start = time.perf_counter()
    _COMPILED[key] = jitted.lower(*args, **static).compile()
    return _COMPILED[key], time.perf_counter() - start


def timed(fn, *args):
    """(fn(*args) after block_until_ready, seconds)."""
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return out, time.perf_counter() - start


@functools.partial(jax.jit, static_argnames=("graphdef", "max_len", "attn_impl"))
def prefill(params, tokens, lengths, *, graphdef, max_len: int, attn_impl: str):
    """Target prefill of right-padded prompts into a fresh cache of max_len rows.
    -> (float32[B, V] logits at each prompt's last token, KVCache)."""
    model = nnx.merge(graphdef, params)
    cache = init_cache(model.config, tokens.shape[0], max_len, model.dtype)
    return model.prefill(tokens, lengths, cache, attn_impl=attn_impl)


# ----------------------------------------------------------------------------- AR decoding


@struct.dataclass
class ARState:
    """The AR loop's carry besides the cache. step: tokens emitted so far by the longest-running
    sequence; out int32[B, N_bucket] (PAD_TOKEN after a sequence stops); num_tokens int32[B]."""

    step: jax.Array
    last_token: jax.Array
    done: jax.Array
    num_tokens: jax.Array
    out: jax.Array
    key: jax.Array
    stop: StopRule


@functools.partial(jax.jit, static_argnames=("new_bucket",))
def ar_start(last_logits, sampling: SamplingParams, key, stop: StopRule, *, new_bucket: int) -> ARState:
    """Pick the first token from the prefill logits float32[B, V]."""
    b = last_logits.shape[0]
    token = pick_token(jax.random.fold_in(key, 0), last_logits, sampling)
    out = jnp.full((b, new_bucket), PAD_TOKEN, jnp.int32).at[:, 0].set(token)
    return ARState(
        step=jnp.asarray(1, jnp.int32),
        last_token=token,
        done=stop.is_eos(token) | (stop.max_new_tokens <= 1),
        num_tokens=jnp.ones((b,), jnp.int32),
        out=out,
        key=key,
        stop=stop,
    )


def _ar_step(model, cache: KVCache, state: ARState, sampling: SamplingParams, attn_impl: str):
    """Feed each sequence's last token, keep its K/V (unless done) and pick the next token."""
    b = state.last_token.shape[0]
    logits, cache = model.forward_block(
        state.last_token[:, None], cache.lengths[:, None], jnp.ones((b, 1, 1), bool), cache, attn_impl=attn_impl
    )
    live = ~state.done
    cache = commit(cache, jnp.zeros((b, 1), jnp.int32), live.astype(jnp.int32))
    token = pick_token(jax.random.fold_in(state.key, state.step), logits[:, 0], sampling)
    token = jnp.where(live, token, PAD_TOKEN)
    num_tokens = state.num_tokens + live.astype(jnp.int32)
    state = state.replace(
        step=state.step + 1,
        last_token=jnp.where(live, token, state.last_token),
        done=state.done | state.stop.is_eos(token) | (num_tokens >= state.stop.max_new_tokens),
        num_tokens=num_tokens,
        out=jax.lax.dynamic_update_slice(state.out, token[:, None], (0, state.step)),
    )
    return cache, state


@functools.partial(jax.jit, static_argnames=("graphdef", "attn_impl"), donate_argnames=("cache", "state"))
def ar_decode(params, cache: KVCache, state: ARState, stop_at, sampling: SamplingParams, *, graphdef, attn_impl: str):
    """The device loop: steps until every sequence is done or `step` reaches stop_at (int32[],
    <= the output bucket; chunked streaming raises it call by call). -> (cache, state)."""

    def body(carry):
        # Merged inside the body so the parameters are loop inputs, not constants.
        return _ar_step(nnx.merge(graphdef, params), *carry, sampling, attn_impl)

    def cond(carry):
        _, s = carry
        return (s.step < stop_at) & ~jnp.all(s.done)

    return jax.lax.while_loop(cond, body, (cache, state))


@functools.partial(jax.jit, static_argnames=("graphdef", "attn_impl"), donate_argnames=("cache", "state"))
def ar_single_step(params, cache: KVCache, state: ARState, sampling: SamplingParams, *, graphdef, attn_impl: str):
    """One AR step as its own program: what a step costs outside the loop. -> (cache, state).
    The cache is donated (updated in place) as in the loop, so the two costs are comparable."""
    return _ar_step(nnx.merge(graphdef, params), cache, state, sampling, attn_impl)


# ----------------------------------------------------------------------------- public API


class Generator:
    """Load once, generate many times: compiled programs are reused for every prompt of a bucket.

    >>> gen = Generator(load_target(None))
    >>> gen.generate("The capital of France is", max_new_tokens=20).text[0]
    """

    def __init__(self, target, draft=None, *, mode: str = DEFAULT_MODE, attn_impl: str | None = None, tree_widths=None):
        if mode not in (*MODES, AUTO_MODE):
            raise UserError(f"unknown mode {mode!r}: choose one of {', '.join((*MODES, AUTO_MODE))}")
        if mode in ("longspec", AUTO_MODE) and draft is None:
            from longspec_jax.draft_io import inference_draft

            draft = inference_draft(target)  # the shipped one, if any
        if mode == AUTO_MODE:
            mode = "longspec" if draft is not None else "ar"
        self.target = target
        self.draft = draft
        self.mode = mode
        self.attn_impl = attention.default_impl() if attn_impl is None else attn_impl
        self.tree_widths = None if tree_widths is None else tuple(int(w) for w in tree_widths)
        self.graphdef, self.params = nnx.split(target.model)

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
        target config's. stream(tokens_so_far) is called every `stream_every` tokens.
        profile=True adds per-step timings to stats.profile."""
        prompts = normalize_prompts(prompt, self.target.tokenizer, chat=chat)
        check_prompts(prompts, self.target.config, max_new_tokens)
        request = DecodeRequest(
            max_new_tokens=int(max_new_tokens),
            sampling=SamplingParams.create(temperature, top_k=top_k, top_p=top_p),
            seed=int(seed),
            eos_token_ids=tuple(self.target.config.eos_token_ids if eos_token_ids is None else eos_token_ids),
            stream=stream,
            stream_every=max(1, int(stream_every)),
            profile=profile,
        )
        if self.mode == "ar":
            result = self._generate_ar(prompts, request)
        else:
            result = _speculative_engine().run(self, prompts, request)
        tokenizer = self.target.tokenizer
        if tokenizer is not None and result.text is None:
            result.text = [decode(tokenizer, t) for t in result.tokens]
        return result

    def run_prefill(self, batch: PromptBatch, cache_len: int):
        """-> (last_logits, cache, seconds, compile seconds)."""
        args = (self.params, jnp.asarray(batch.tokens), jnp.asarray(batch.lengths))
        run, compile_s = compiled(prefill, *args, graphdef=self.graphdef, max_len=cache_len, attn_impl=self.attn_impl)
        (last_logits, cache), seconds = timed(run, *args)
        return last_logits, cache, seconds, compile_s

    def _generate_ar(self, prompts: list[list[int]], request: DecodeRequest) -> GenerationResult:
        prompt_bucket, new_bucket, cache_len = plan_lengths(max(map(len, prompts)), request.max_new_tokens)
        batch = prompt_batch(prompts, prompt_bucket)
        last_logits, cache, prefill_s, compile_s = self.run_prefill(batch, cache_len)

        stop = StopRule.create(request.eos_token_ids, request.max_new_tokens)
        key = jax.random.key(request.seed)
        start, c1 = compiled(ar_start, last_logits, request.sampling, key, stop, new_bucket=new_bucket)
        state_shape = jax.eval_shape(
            functools.partial(ar_start, new_bucket=new_bucket), last_logits, request.sampling, key, stop
        )
        stop_at = jnp.asarray(new_bucket, jnp.int32)
        run_loop, c2 = compiled(
            ar_decode,
            self.params,
            cache,
            state_shape,
            stop_at,
            request.sampling,
            graphdef=self.graphdef,
            attn_impl=self.attn_impl,
        )
        compile_s += c1 + c2

        t0 = time.perf_counter()
        state = start(last_logits, request.sampling, key, stop)
        if request.stream is None:
            cache, state = run_loop(self.params, cache, state, stop_at, request.sampling)
        else:
            while True:
                chunk_end = jnp.asarray(min(int(state.step) + request.stream_every, new_bucket), jnp.int32)
                cache, state = run_loop(self.params, cache, state, chunk_end, request.sampling)
                out, num_tokens, done = jax.device_get((state.out, state.num_tokens, state.done))
                request.stream(finish_tokens(out, num_tokens, request.eos_token_ids))
                if done.all():
                    break
        jax.block_until_ready(state)
        decode_s = time.perf_counter() - t0

        tokens = finish_tokens(*jax.device_get((state.out, state.num_tokens)), request.eos_token_ids)
        rounds = int(state.step) - 1
        target_cache_bytes = cache_bytes(cache)
        profile = self._profile_ar_step(cache, state, request.sampling, decode_s, rounds) if request.profile else {}
        return GenerationResult(
            tokens=tokens,
            stats=make_stats(
                prefill_s=prefill_s,
                decode_s=decode_s,
                tokens=tokens,
                rounds=rounds,
                tau=1.0,
                target_cache_bytes=target_cache_bytes,
                draft_cache_bytes=0,
                prompt_tokens=int(batch.lengths.sum()),
                compile_s=compile_s,
                profile=profile,
            ),
        )

    def _profile_ar_step(
        self, cache, state, sampling, decode_s: float, rounds: int, repeats: int = 5
    ) -> dict[str, float]:
        """A step inside the loop vs the same step as its own program (GPU.md: they should match).
        Runs on the finished state (consumes the cache): every sequence is done, so lengths stay put
        while the step still computes the full batch."""
        step, _ = compiled(
            ar_single_step, self.params, cache, state, sampling, graphdef=self.graphdef, attn_impl=self.attn_impl
        )
        seconds = []
        for _ in range(repeats + 1):  # the first run warms up
            (cache, state), s = timed(step, self.params, cache, state, sampling)
            seconds.append(s)
        return {
            "step_in_loop_ms": 1e3 * decode_s / max(rounds, 1),
            "step_alone_ms": 1e3 * statistics.median(seconds[1:]),
        }


def make_stats(
    *,
    prefill_s,
    decode_s,
    tokens,
    rounds,
    tau,
    target_cache_bytes,
    draft_cache_bytes,
    prompt_tokens,
    compile_s=0.0,
    profile=None,
) -> GenerationStats:
    """GenerationStats with new_tokens / tokens_per_s derived from the returned tokens."""
    new_tokens = sum(len(t) for t in tokens)
    return GenerationStats(
        prefill_s=prefill_s,
        decode_s=decode_s,
        new_tokens=new_tokens,
        tokens_per_s=new_tokens / decode_s if decode_s > 0 else 0.0,
        tau=tau,
        rounds=rounds,
        draft_cache_bytes=draft_cache_bytes,
        target_cache_bytes=target_cache_bytes,
        prompt_tokens=prompt_tokens,
        compile_s=compile_s,
        profile=dict(profile or {}),
    )


def _speculative_engine():
    from longspec_jax import speculative  # imported late: it builds on this module

    return speculative


def generate(
    target,
    prompt_ids,
    *,
    mode: str = DEFAULT_MODE,
    draft=None,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    attn_impl: str | None = None,
    tree_widths=None,
    eos_token_ids: Sequence[int] | None = None,
    stream: StreamCallback | None = None,
    stream_every: int = 32,
    profile: bool = False,
) -> GenerationResult:
    """Generate from a target: prompt_ids is list[int] (one prompt) or list[list[int]] (a batch;
    lengths may differ), or text when the target has a tokenizer. See `Generator.generate`."""
    return Generator(target, draft, mode=mode, attn_impl=attn_impl, tree_widths=tree_widths).generate(
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
