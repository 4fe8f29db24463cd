"""What a round of each speculation candidate costs, kept in memory and on disk.

A calibration is measured once for a (target, draft, batch size, cache rows, sampling kind,
candidates, device) and reused: first from this process's memory, then from a small JSON file
under the project's cache folder, so a second process does not pay for it again. A file that
cannot be read or written is ignored (the engine measures again); it never fails a run.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import jax

_MEMORY: dict[str, dict[str, float]] = {}


def calibration_key(**parts) -> str:
    """A stable hex key of the things a round's cost depends on, plus the device and jax version."""
    device = jax.devices()[0]
    parts = {**parts, "device": f"{device.platform}:{getattr(device, 'device_kind', '')}", "jax": jax.__version__}
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
    if folder is None:
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f"{key}.json.tmp"
        tmp.write_text(json.dumps({"seconds_per_round": seconds, **about}, indent=1, default=str))
        tmp.replace(folder / f"{key}.json")
    except OSError:
        pass


def forget_calibrations() -> None:
    """Drop the in-memory copies (tests; a process that changed devices)."""
    _MEMORY.clear()
