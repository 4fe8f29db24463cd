"""The decode kit: what every decode mode shares around its device loop.

- results: `GenerationResult` / `GenerationStats` (`make_stats`, `cache_bytes`);
- prompts: `normalize_prompts` (text / ids / batches -> id lists) and `check_prompts` (ids in the
  vocabulary, prompt + max_new_tokens inside the window), each naming the fix on bad input;
- static shapes: `bucket_length`, `plan_lengths` (prompt bucket, output bucket, cache rows; roomy
  where the device's free memory allows) and
  `prompt_batch` (right-padded); one compiled program then serves every prompt of a bucket;
- `StopRule` (EOS ids / max_new_tokens as arrays) and `finish_tokens` (truncation after EOS);
- `prefill` (jitted; parameters are arguments) and `compiled`, the per-process compile cache keyed
  by function, argument shapes and static values, which also times compilation apart from running.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from longspec_jax.attention import CACHE_ROW_TILE
from longspec_jax.errors import UserError
from longspec_jax.model import init_cache
from longspec_jax.tokenizer import encode_prompt

PAD_TOKEN = -1  # fills the output buffer after a sequence stops; never returned
SMALL_BUCKETS_UP_TO = 256  # up to this, lengths round up to a power of two (>= 16); above, see bucket_length


# ----------------------------------------------------------------------------- results


@dataclasses.dataclass
class GenerationStats:
    """Timings and counts of one generate call. tokens_per_s = new_tokens / decode_s (all
    sequences together; the first token of each comes out of prefill). tau = mean tokens emitted
    per target forward after prefill (1 for AR); rounds = target forwards after prefill. policy
    (mode "auto"): per candidate the rounds it ran, its mean tokens kept per round and its
    calibrated round time, where the calibration came from, and the runs of one candidate's rounds
    in a row (adaptive.py). runs: each host call of the device loop in order, {"what": "loop",
    "rounds", "ms"} (the host's read of the state included), and with profile=True first
    {"what": "start"}: the first state, with any calibration rounds (timing it apart costs a wait)."""

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
    policy: dict[str, Any] = dataclasses.field(default_factory=dict)
    runs: list[dict[str, Any]] = dataclasses.field(default_factory=list)

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
        if self.policy:
            used = [(n, c["rounds"]) for n, c in self.policy["candidates"].items() if c["rounds"]]
            text += " | rounds " + ", ".join(f"{n} {r}" for n, r in used) + f" in {self.policy['candidate_runs']} runs"
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
    """Bytes held by all arrays of a pytree (a KV cache, a draft state; jax.eval_shape results too)."""
    return int(sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


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
    policy=None,
    runs=None,
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
        policy=dict(policy or {}),
        runs=list(runs or []),
    )


# ----------------------------------------------------------------------------- prompts and shapes


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


# A power-of-two cache may take at most this share of the device's free bytes; the rest is left for
# the prefill's activations and the loop's other buffers.
ROOMY_CACHE_SHARE = 0.75


def bucket_length(n: int) -> int:
    """The padded size for a length n: a power of two >= 16 up to 256, then quarter-octave steps
    (256 < n <= 512: multiples of 64; 512 < n <= 1024: of 128; ...), so padding stays under 25 %
    while a 2k-8k range holds only 12 buckets (one prefill compilation each)."""
    if n <= SMALL_BUCKETS_UP_TO:
        return max(16, 1 << (max(n, 1) - 1).bit_length())
    step = (1 << (n - 1).bit_length()) // 8
    return -(-n // step) * step


def plan_lengths(
    longest_prompt: int, max_new_tokens: int, *, slack: int = 0, row_bytes: int = 0, free_bytes: int | None = None
) -> tuple[int, int, int]:
    """(prompt bucket, output bucket, cache rows). `slack`: extra cache rows a mode writes past the
    last kept token (e.g. a speculative tree).

    The cache rows are a power of two: the decode loop's shapes depend on them alone, so prompts
    from 2k to 4k tokens (say) share one compiled loop and only the cheap prefill compiles per
    prompt bucket. The Pallas and cuDNN kernels read only the rows in use, so a roomier cache
    costs no time on GPU. It costs memory, up to twice the rows needed: where the device's free
    bytes are known (`device_free_bytes`) and such a cache of `row_bytes` a row would take more than
    ROOMY_CACHE_SHARE of them, the rows are the ones needed in whole CACHE_ROW_TILE tiles instead (one more
    loop shape to compile), and a cache that does not fit even so is an error naming the fix."""
    prompt_bucket = bucket_length(longest_prompt)
    new_bucket = bucket_length(max_new_tokens)
    needed = prompt_bucket + new_bucket + slack
    rows = 1 << (needed - 1).bit_length()
    if free_bytes is not None and rows * row_bytes > ROOMY_CACHE_SHARE * free_bytes:
        rows = -(-needed // CACHE_ROW_TILE) * CACHE_ROW_TILE
        if rows * row_bytes > free_bytes:
            raise UserError(
                f"the KV cache for {longest_prompt} prompt tokens and {max_new_tokens} new ones needs "
                f"{rows * row_bytes / 2**30:.1f} GiB and the device has {free_bytes / 2**30:.1f} GiB free: "
                "shorten the prompt, lower max_new_tokens or the batch, or let JAX take more of the GPU "
                "(XLA_PYTHON_CLIENT_MEM_FRACTION, 0.75 by default)"
            )
    return prompt_bucket, new_bucket, rows


def cache_row_bytes(config, batch: int, dtype) -> int:
    """Bytes one cache row takes across a batch's sequences (K and V of every layer, `init_cache`'s)."""
    return 2 * config.num_layers * batch * config.num_kv_heads * config.head_dim * jnp.dtype(dtype).itemsize


def device_free_bytes() -> int | None:
    """Bytes the default device's allocator can still hand out, or None where it does not say (CPU)."""
    stats = jax.devices()[0].memory_stats()
    if not stats or "bytes_limit" not in stats:
        return None
    return stats["bytes_limit"] - stats.get("bytes_in_use", 0)


def prompt_batch(prompts: list[list[int]], prompt_bucket: int) -> PromptBatch:
    """Right-pad validated prompts to [B, prompt_bucket]."""
    tokens = np.zeros((len(prompts), prompt_bucket), np.int32)
    for row, ids in zip(tokens, prompts):
        row[: len(ids)] = ids
    return PromptBatch(tokens, np.asarray([len(p) for p in prompts], np.int32))


def _is_token_id(t) -> bool:
    return isinstance(t, numbers.Integral) and not isinstance(t, bool)


def _token_ids(ids) -> list[int]:
    """A sequence of token ids as ints; anything else (floats, nested lists) names the fix."""
    if isinstance(ids, Sequence) and all(type(t) is int for t in ids):
        return list(ids)  # the common case: no ABC check per token (8 ms for 2,500 tokens on a slow CPU)
    bad = [t for t in ids if not _is_token_id(t)] if isinstance(ids, Sequence) else [ids]
    if bad:
        bad = bad[0]
        raise UserError(
            f"token ids must be integers, got {bad!r} ({type(bad).__name__}): pass a list of int token ids "
            "(e.g. [1, 2, 3]), a list of such lists, or text"
        )
    return [int(t) for t in ids]


def normalize_prompts(prompt, tokenizer=None, *, chat: bool = False) -> list[list[int]]:
    """str | list[str] | list[int] | list[list[int]] (or int arrays) -> list of token-id lists."""
    if isinstance(prompt, np.ndarray | jax.Array):
        prompt = np.asarray(prompt).tolist()
    if isinstance(prompt, str):
        prompt = [prompt]
    if not isinstance(prompt, Sequence) or len(prompt) == 0:
        raise UserError("empty prompt: pass at least one token (or non-empty text)")
    prompt = [np.asarray(p).tolist() if isinstance(p, np.ndarray | jax.Array) else p for p in prompt]
    if not any(isinstance(p, str | Sequence) for p in prompt):
        prompt = [prompt]  # one prompt of ids
    if tokenizer is None and any(isinstance(p, str) for p in prompt):
        raise UserError(
            "this target has no tokenizer: pass token ids instead of text, or load a checkpoint with a tokenizer"
        )
    prompts = []
    for p in prompt:
        ids = encode_prompt(tokenizer, p, chat=chat) if isinstance(p, str) else _token_ids(p)
        if not ids:
            raise UserError("empty prompt: every prompt needs at least one token")
        prompts.append(ids)
    return prompts


def check_prompts(prompts: list[list[int]], config, max_new_tokens: int) -> None:
    """Token ids in range and prompt + max_new_tokens inside the context window."""
    if not isinstance(max_new_tokens, numbers.Real) or int(max_new_tokens) != max_new_tokens or max_new_tokens < 1:
        raise UserError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens}")
    for ids in prompts:
        bad = [t for t in ids if not 0 <= t < config.vocab_size]
        if bad:
            raise UserError(
                f"token id {bad[0]} is outside the target's vocabulary [0, {config.vocab_size}): check the tokenizer"
            )
    longest = max(len(p) for p in prompts)
    window = config.max_position_embeddings
    if max_new_tokens >= window:
        raise UserError(
            f"max_new_tokens={max_new_tokens} does not fit the target's context window of {window} positions "
            f"(the prompt needs at least one): lower max_new_tokens to at most {window - 1}"
        )
    if longest + max_new_tokens > window:
        raise UserError(
            f"prompt has {longest} tokens; with max_new_tokens={max_new_tokens} that needs "
            f"{longest + max_new_tokens} positions but the target's context window is {window}: shorten "
            f"the prompt to at most {window - max_new_tokens} tokens or lower max_new_tokens"
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


def forget_compiled() -> None:
    """Drop every program `compiled` and JAX's own caches hold, so their executables can be freed (a
    process that compiles thousands of programs, such as a test run on the CPU, otherwise keeps each
    one's code mapped until it exits)."""
    _COMPILED.clear()
    jax.clear_caches()


@jax.jit
def _packed(leaves):
    """Every leaf (32-bit or bool arrays) as int32 words in one flat vector."""
    words = [
        jax.lax.bitcast_convert_type(x, jnp.int32) if x.dtype == jnp.float32 else x.astype(jnp.int32) for x in leaves
    ]
    return jnp.concatenate([w.reshape(-1) for w in words])


def fetch(tree):
    """jax.device_get(tree) in one device-to-host copy: a GPU pays ~0.1-0.2 ms per array read back
    (H200: reading a decode's progress and mode auto's policy, 18 small arrays, took 2.3 ms), so the
    leaves (int32, float32 or bool) are packed into one int32 vector on the device and unpacked here."""
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves:
        return tree
    for x in leaves:
        if x.dtype not in (jnp.int32, jnp.float32, jnp.bool_):
            raise TypeError(f"fetch packs int32, float32 and bool arrays, not {x.dtype}")
    words = np.asarray(_packed(leaves))
    out, at = [], 0
    for x in leaves:
        n = math.prod(x.shape)
        chunk = words[at : at + n].reshape(x.shape)
        at += n
        out.append(chunk.view(np.float32) if x.dtype == jnp.float32 else chunk.astype(x.dtype))
    return jax.tree.unflatten(treedef, out)


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
