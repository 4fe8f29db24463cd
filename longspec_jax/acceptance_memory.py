"""What each speculation candidate kept per round in earlier requests of the same kind: where the
adaptive policy starts the next one.

Without it a request of mode "auto" starts knowing nothing: each candidate's estimate is its
break-even and each is tried in the first rounds (policy.py). A new kind of text needs that trial;
a workload of like requests pays it again and again: on a CPU at T = 1 a prompt-lookup chain costs
about four AR steps and keeps one token, twice in a 128-token request. So after each request the
engine keeps, per candidate, the tokens its rounds kept per sequence (a mean over the requests'
rounds, the older ones counted as at most MEMORY_ROUNDS rounds so that it follows a change of
workload) and its retry wait, in memory and in a small JSON file under the project's cache folder
(`$LONGSPEC_CACHE/acceptance`; rewritten at most every SAVE_EVERY_S and when the process exits).
The next request of the same kind (the same target and draft weights, candidates, batch size and
sampling settings) starts each remembered candidate from them (`policy.with_memory`; when sampling
the estimate weighs as the rounds behind it, at most SAMPLED_EVIDENCE, greedy as one round): picked
at once where its remembered rate is the best, else retried when its wait is out (when sampling,
the first wait: see `with_remembered`), not tried at the start. Tokens per round depend on neither
the device nor the cache's size, so neither is part of the key. A file that cannot be read or
written is ignored.

The price: requests of one key that differ in kind (code, where a tree keeps five tokens a round,
and prose, where it keeps two) start from their mix, and greedy, a candidate remembered as losing
is retried only when its remembered wait is out, so a short request of the other kind may not try
it at all. Deleting `$LONGSPEC_CACHE/acceptance` starts afresh.
"""

from __future__ import annotations

import atexit
import copy
import hashlib
import json
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from longspec_jax.compile_cache import cache_root, keep_json
from longspec_jax.policy import AR, FIRST_WAIT, with_costs_and_memory, with_memory

MEMORY_ROUNDS = 64  # the older requests' rounds count as at most this many against a new request's
SAMPLED_EVIDENCE = 16  # when sampling, a remembered estimate weighs as at most this many rounds
FINGERPRINT_ELEMENTS = 4096  # of each weight array, hashed to tell two checkpoints of one shape apart
SAVE_EVERY_S = 10.0  # a key's file is rewritten at most this often (and when the process exits)
_MEMORY: dict[str, dict[str, dict[str, float]]] = {}
_UNSAVED: dict[str, Path | None] = {}  # keys whose latest entries are not on disk yet, and their folder
_SAVED_AT: dict[str, float] = {}  # when each key was last written (time.monotonic)


# One compiled call, not a dozen eager operations per request; with the calibration's costs, one call
# for both (with two, and the memory's key hashed per request, mode auto's host spent 1.2-1.5 ms more
# before its loop than a fixed mode's on the H200, 2026-12-04).
@jax.jit
def _with_memory(policy, memory):
    """policy.with_memory from one float32[3, K] array (tokens, wait, rounds): one host-to-device
    copy instead of three (each costs a GPU ~0.1-0.2 ms)."""
    return with_memory(policy, memory[0], memory[1].astype(jnp.int32), memory[2])


@jax.jit
def _with_costs_and_memory(policy, costs_and_memory):
    """policy.with_costs_and_memory from one float32[4, K] array (seconds, tokens, wait, rounds)."""
    seconds, tokens, wait, rounds = costs_and_memory
    return with_costs_and_memory(policy, seconds, tokens, wait.astype(jnp.int32), rounds)


def weights_fingerprint(tree) -> str:
    """A short hash of a pytree of arrays: each leaf's shape, dtype and about its first
    FINGERPRINT_ELEMENTS values (its leading rows: cheap at any model size; two checkpoints of one
    architecture differ there)."""
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(tree):
        head = leaf
        while head.ndim > 1 and head.size > FINGERPRINT_ELEMENTS:
            head = head[0]  # a slice: flattening a large weight first would copy all of it
        digest.update(f"{leaf.shape}{leaf.dtype}".encode())
        digest.update(np.asarray(jax.device_get(head)).reshape(-1)[:FINGERPRINT_ELEMENTS].tobytes())
    return digest.hexdigest()[:32]


def memory_key(**parts) -> str:
    """A stable hex key of what a candidate's tokens per round depend on."""
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def memory_folder() -> Path | None:
    try:
        return cache_root() / "acceptance"
    except RuntimeError:  # no home folder to put it under
        return None


def _valid(entry) -> bool:
    return (
        isinstance(entry, dict)
        and all(isinstance(entry.get(f), int | float) for f in ("tokens_per_round", "rounds", "wait"))
        and math.isfinite(entry["tokens_per_round"])
        and entry["tokens_per_round"] >= 1.0
        and entry["rounds"] > 0
        and entry["wait"] > 0
    )


def load_memory(key: str, folder: Path | None) -> dict[str, dict[str, float]]:
    """{candidate name: {"tokens_per_round", "rounds", "wait"}}, empty when nothing is kept."""
    if key not in _MEMORY and folder is not None:
        try:
            entries = json.loads((folder / f"{key}.json").read_text())["candidates"]
        except (OSError, ValueError, KeyError, TypeError):
            entries = {}
        if isinstance(entries, dict):
            _MEMORY[key] = {str(name): entry for name, entry in entries.items() if _valid(entry)}
    return _MEMORY.get(key, {})


def save_memory(key: str, entries: dict[str, dict[str, float]], folder: Path | None, clock=time.monotonic) -> None:
    """Keep `entries` in memory; on disk at most every SAVE_EVERY_S per key (writing the file after
    every request cost it about a millisecond), and at the latest when the process exits
    (`flush_memory`)."""
    _MEMORY[key] = dict(entries)
    _UNSAVED[key] = folder
    if clock() - _SAVED_AT.get(key, -math.inf) >= SAVE_EVERY_S:
        _save(key, clock)


def _save(key: str, clock=time.monotonic) -> None:
    keep_json(_UNSAVED.pop(key), key, {"candidates": _MEMORY[key]})
    _SAVED_AT[key] = clock()


@atexit.register
def flush_memory() -> None:
    """Write every key whose latest entries are not on disk yet."""
    for key in list(_UNSAVED):
        _save(key)


def memory_snapshot() -> dict[str, dict[str, dict[str, float]]]:
    """A copy of what this process remembers, for `restore_memory` (a benchmark that times one
    request several times starts each timing from what the earlier requests left)."""
    return copy.deepcopy(_MEMORY)


def restore_memory(snapshot: dict[str, dict[str, dict[str, float]]]) -> None:
    """Remember exactly what `snapshot` held (kept on disk as usual from the next save on)."""
    _MEMORY.clear()
    _MEMORY.update(copy.deepcopy(snapshot))


def forget_memory() -> None:
    """Drop the in-memory copies, after writing what is not on disk yet (tests; a process that
    starts a new workload)."""
    flush_memory()
    _MEMORY.clear()
    _SAVED_AT.clear()


def with_remembered(state, names: tuple[str, ...], key: str, sampled: bool = False, seconds=None):
    """The loop state with each remembered candidate's estimate and wait set (policy.with_memory)
    -> (state, the names of the candidates that start from memory). seconds: the calibration's
    seconds per round of each candidate, set first (policy.with_costs) in the same compiled call;
    None leaves the costs as they are. sampled: the request samples,
    and a remembered estimate weighs as the rounds behind it (at most SAMPLED_EVIDENCE): what a
    drawn token keeps is a property of draft and target, which one round's luck must not overturn;
    and a remembered loser is retried after the first wait (policy.FIRST_WAIT), not its remembered
    one. Else a short first sample (the calibration's rounds of a coupled tree, ~20, once said 1.52
    tokens a round where the tree keeps 2.25 and breaks even at 1.72) shut the tree out of every
    later request: never retried, its memory never corrected, mode auto ran AR (0.89x on the H200,
    2026-12-03). Greedy, it weighs as one round: what a tree or a prompt-lookup chain keeps follows
    the text (a chain that kept six tokens a round on the last request's code may keep one on this
    one's), and on a CPU a round of either costs several AR steps, so the first trial decides
    (policy.GREEDY_TRIAL_AR_STEPS: a few rounds of a tree that costs two AR steps, one where it costs
    ten)."""
    if seconds is None:
        remembered, tokens, wait, rounds = memory_arrays(load_memory(key, memory_folder()), names, sampled)
        if not remembered:
            return state, ()
        policy = _with_memory(state.proposal.policy, np.stack([tokens, wait, rounds]).astype(np.float32))
    else:
        setup, remembered = policy_setup(names, key, sampled, seconds)
        policy = _with_costs_and_memory(state.proposal.policy, setup)
    return state.replace(proposal=state.proposal.replace(policy=policy)), remembered


def policy_setup(names: tuple[str, ...], key: str, sampled: bool, seconds) -> tuple[np.ndarray, tuple[str, ...]]:
    """(float32[4, K]: the seconds per round of each candidate and what `with_remembered` sets from
    the memory (tokens per round, wait, rounds), the names of the remembered candidates): what
    `decode_loop.start` sets into the policy when the costs are known before the request starts, so
    that a request of mode auto makes no call of its own for it."""
    remembered, tokens, wait, rounds = memory_arrays(load_memory(key, memory_folder()), names, sampled)
    return np.stack([np.asarray(seconds, np.float32), tokens, wait, rounds]).astype(np.float32), remembered


def remember(key: str, names: tuple[str, ...], policy) -> None:
    """After a request: fold what each candidate kept in it (the policy read back, numpy arrays)
    into the memory of this kind of request."""
    folder = memory_folder()
    save_memory(key, folded(load_memory(key, folder), names, policy), folder)


def memory_arrays(kept: dict, names: tuple[str, ...], sampled: bool = False):
    """What `with_remembered` sets, from the entries `load_memory` gives: (the names of the
    remembered candidates other than AR, tokens float32[K] (NaN where none), wait int32[K], rounds
    float32[K] the evidence each estimate weighs as)."""
    remembered = tuple(n for k, n in enumerate(names) if k != AR and n in kept)
    tokens = np.asarray([kept[n]["tokens_per_round"] if n in remembered else np.nan for n in names], np.float32)
    wait = np.asarray([(FIRST_WAIT if sampled else kept[n]["wait"]) if n in remembered else 0 for n in names], np.int32)
    rounds = np.asarray(
        [min(kept[n]["rounds"], SAMPLED_EVIDENCE) if sampled and n in remembered else 1 for n in names], np.float32
    )
    return remembered, tokens, wait, rounds


def folded(entries: dict, names: tuple[str, ...], policy) -> dict:
    """The memory's entries after a request whose policy (read back, numpy arrays) is given: each
    candidate's mean tokens per round, the older requests' rounds weighed as at most MEMORY_ROUNDS."""
    entries = dict(entries)
    for k, name in enumerate(names):
        active = int(policy.active[k])
        if k == AR or active == 0:
            continue
        mean, rounds = float(policy.emitted[k]) / active, int(policy.rounds[k])
        old = entries.get(name)
        if old is not None:
            weight = min(old["rounds"], MEMORY_ROUNDS)
            mean = (old["tokens_per_round"] * weight + mean * rounds) / (weight + rounds)
            rounds += weight
        entries[name] = {"tokens_per_round": max(mean, 1.0), "rounds": rounds, "wait": int(policy.wait[k])}
    return entries
