"""What a round of each speculation candidate costs: measured once, kept in memory and on disk.

The adaptive policy (policy.py) needs, for the current target, draft, batch size, cache rows,
sampling filters, candidates and device, the seconds one round of each candidate takes. The first
request of such a kind measures them on its own first rounds: each candidate in turn is forced for
a few rounds (one to warm up, then enough to time), which are real rounds of the generation (every
candidate is exact), so nothing is wasted but the time a slower candidate takes. The result is kept
in this process's memory and in a small JSON file under the project's cache folder
(`$LONGSPEC_CACHE/calibration`), so a second process does not measure again. A file that cannot be
read or written is ignored; it never fails a run.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import time
from pathlib import Path

import jax
import numpy as np

import pallas_kernels
from longspec_jax.compile_cache import cache_root, keep_json

TIMED_SECONDS = 0.02  # about how long each candidate's timed run takes
PROBE_ROUNDS = 2  # rounds that size the timed run
MAX_TIMED_ROUNDS = 32
CALL_REPEATS = 3  # calls without a round, the fastest taken as what a call costs besides its rounds
UNMEASURED_SECONDS = 1.0  # a candidate's cost a round until it is measured: too dear to pick
METHOD = 2  # part of the key: costs measured another way are measured again
_MEMORY: dict[str, dict[str, float]] = {}


@functools.cache
def library_fingerprint() -> str:
    """A hash of this library's and its kernels' source files: a round's cost depends on the code
    that runs it, so costs measured by another version (a faster kernel, another launch) are
    measured again rather than trusted."""
    digest = hashlib.sha256()
    for package in (Path(__file__).parent, Path(pallas_kernels.__file__).parent):
        for path in sorted(package.glob("*.py")):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def calibration_key(**parts) -> str:
    """A stable hex key of the things a round's cost depends on, plus the device, the jax version
    and the library's own code (library_fingerprint)."""
    device = jax.devices()[0]
    parts = {
        **parts,
        "device": f"{device.platform}:{getattr(device, 'device_kind', '')}",
        "jax": jax.__version__,
        "library": library_fingerprint(),
        "method": METHOD,
    }
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def load_calibration(key: str, folder: Path | None) -> dict[str, float] | None:
    """The seconds per round of each candidate by name, or None when not measured yet."""
    if key in _MEMORY:
        return _MEMORY[key]
    if folder is None:
        return None
    try:
        seconds = json.loads((folder / f"{key}.json").read_text())["seconds_per_round"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(seconds, dict) or not all(
        isinstance(v, int | float) and math.isfinite(v) and v > 0 for v in seconds.values()
    ):
        return None
    _MEMORY[key] = {str(k): float(v) for k, v in seconds.items()}
    return _MEMORY[key]


def save_calibration(key: str, seconds: dict[str, float], folder: Path | None, **about) -> None:
    """Keep `seconds` (per round, by candidate name) in memory and, when possible, on disk."""
    _MEMORY[key] = dict(seconds)
    keep_json(folder, key, {"seconds_per_round": seconds, **about})


def forget_calibrations() -> None:
    """Drop the in-memory copies (tests; a process that changed devices)."""
    _MEMORY.clear()


def calibration_folder() -> Path | None:
    try:
        return cache_root() / "calibration"
    except RuntimeError:  # no home folder to put it under
        return None


def measure_rounds(state, run, candidates: int, only=None, clock=time.perf_counter):
    """Seconds per round of each candidate, timed on the generation's own rounds -> (state after
    them, float seconds[K], NaN where the request ended first). run(state, rounds, candidate) runs
    a candidate's loop until `rounds` rounds in total. Each candidate runs one round to warm up;
    then calls that run no round measure what a call costs besides its rounds (launch, the host's
    wait; the fastest of CALL_REPEATS); PROBE_ROUNDS rounds size a timed run of about TIMED_SECONDS,
    and its time less that call cost, over its rounds, is the cost of a round. A candidate whose
    probe alone took TIMED_SECONDS is priced from the probe (a tree round on a CPU costs twenty AR
    rounds: four more of them in a first request are seconds). Each candidate's
    timed run takes about the same time, so an error in the call cost shifts every candidate's cost
    by about the same fraction and leaves the policy's choice alone. (Taking the difference of a
    2-round and a 6-16-round call instead said 0.37-0.51 ms for an AR round that costs 0.78 ms in
    the same loop on the H200.) only: the candidate indices to measure (default: all; the others
    stay NaN). `clock` reads seconds (tests pass a simulated one)."""

    def timed(state, rounds, k):
        start = clock()
        state = jax.block_until_ready(run(state, rounds, k))
        return state, clock() - start

    seconds = np.full((candidates,), np.nan)
    for k in range(candidates) if only is None else only:
        state = jax.block_until_ready(run(state, int(state.rounds) + 1, k))
        base = int(state.rounds)
        call = math.inf
        for _ in range(CALL_REPEATS):
            state, t = timed(state, base, k)
            call = min(call, t)
        state, t = timed(state, base + PROBE_ROUNDS, k)
        probed = int(state.rounds) - base
        if probed == 0:  # the request has ended
            continue
        guess = max(t - call, 1e-6) / probed
        if t - call >= TIMED_SECONDS:  # the probe took a timed run's length: it is the timed run
            seconds[k] = guess
            continue
        n = int(np.clip(TIMED_SECONDS / guess, PROBE_ROUNDS + 2, MAX_TIMED_ROUNDS))
        base = int(state.rounds)
        state, t = timed(state, base + n, k)
        ran = int(state.rounds) - base
        seconds[k] = max(t - call, 1e-6) / ran if ran else guess
    return state, seconds


def kept_costs(names: tuple[str, ...], key: str) -> np.ndarray | None:
    """float seconds[K] per round of each candidate when every one was measured before (in memory or
    on disk), else None: the request measures them (`calibrated`)."""
    kept = load_calibration(key, calibration_folder()) or {}
    if not all(n in kept for n in names):
        return None
    return np.asarray([kept[n] for n in names])


def unmeasured_setup(candidates: int) -> np.ndarray:
    """float32[4, K]: `decode_loop.start`'s policy setup for a request that measures the costs itself:
    every candidate at UNMEASURED_SECONDS, nothing remembered (the costs and the memory are set after
    the measuring rounds, acceptance_memory.with_remembered)."""
    k = candidates
    return np.stack([np.full(k, UNMEASURED_SECONDS), np.full(k, np.nan), np.zeros(k), np.ones(k)]).astype(np.float32)


def calibrated(state, run, names: tuple[str, ...], key: str):
    """The policy's seconds per round of each candidate: from memory or disk when this kind of
    request was measured before, else measured now on the first rounds (each candidate's rounds
    also count as evidence for the policy). A request that ends before every candidate ran keeps
    what it measured, and the next request measures only the rest; until then a candidate not
    measured costs UNMEASURED_SECONDS a round, so the policy leaves it alone. -> (state after any
    measuring rounds, float seconds[K], where they came from: "kept" or "measured"). The caller sets
    them into the policy (acceptance_memory.with_remembered, with what earlier requests kept)."""
    folder = calibration_folder()
    kept = {n: s for n, s in (load_calibration(key, folder) or {}).items() if n in names}
    missing = [k for k, n in enumerate(names) if n not in kept]
    source = "kept"
    if missing:
        only = {} if len(missing) == len(names) else {"only": missing}
        state, measured = measure_rounds(state, run, len(names), **only)
        source = "measured"
        new = {names[k]: float(measured[k]) for k in missing if np.isfinite(measured[k])}
        if new:
            kept = {**kept, **new}
            save_calibration(key, kept, folder)
    seconds = np.asarray([kept.get(n, UNMEASURED_SECONDS) for n in names])
    return state, seconds, source


def policy_stats(proposer, policy, source, remembered=()) -> dict:
    """What the policy did in a request, per candidate: rounds run, mean tokens kept per sequence
    and round, the policy's estimate of that at the end (what it would choose by next), and the
    calibrated milliseconds per round (with where they came from); the runs of
    one candidate's rounds in a row (a switch starts one; so does each call of the loop, the
    calibration's included); and the candidates that started from what earlier requests kept
    (acceptance_memory.py)."""
    if policy is None:
        return {}
    stats = {
        "calibration": source,
        "remembered": list(remembered),
        "candidate_runs": int(policy.candidate_runs),
        "candidates": {},
    }
    for i, name in enumerate(proposer.names):
        rounds, active = int(policy.rounds[i]), int(policy.active[i])
        stats["candidates"][name] = {
            "rounds": rounds,
            "tokens_per_round": float(policy.emitted[i]) / active if active else None,
            "estimate": float(policy.tokens_per_round[i]),
            "ms_per_round": 1e3 * float(policy.seconds_per_round[i]),
        }
    return stats
