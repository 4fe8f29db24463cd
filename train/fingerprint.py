"""What the training data is, independent of how its paths are spelt: per file, its size and the
SHA-256 of its bytes, in the order the files are read (the order decides the record indices that a
checkpointed data iterator points at).

Hashing reads every byte once (about 1 GB/s), so digests are cached in a JSON file keyed by the
file's resolved path, size and modification time: an unchanged file is not read again, and a file
replaced in place gets a new modification time and is hashed afresh.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


def data_fingerprint(files: list[Path], cache_path: Path | None = None) -> list[dict]:
    """[{"name", "bytes", "sha256"}] for `files`, in order. Writes the cache when one is given."""
    cache = _read_cache(cache_path)
    out, fresh = [], {}
    for f in files:
        stat = f.stat()
        key = f"{f.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
        digest = cache.get(key) or _sha256(f)
        fresh[key] = digest
        out.append({"name": f.name, "bytes": stat.st_size, "sha256": digest})
    if cache_path is not None and fresh != cache:
        _write_cache(cache_path, {**cache, **fresh})
    return out


def first_difference(saved: list[dict], now: list[dict]) -> str | None:
    """None when both fingerprints name the same bytes in the same order, else what differs, in words."""
    if len(saved) != len(now):
        return f"{len(saved)} data files then, {len(now)} now"
    for before, after in zip(saved, now):
        if (before["bytes"], before["sha256"]) != (after["bytes"], after["sha256"]):
            return (
                f"data file {after['name']} ({after['bytes']} bytes) holds other data than the checkpoint's "
                f"{before['name']} ({before['bytes']} bytes)"
            )
    return None


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _read_cache(path: Path | None) -> dict:
    if path is None or not path.is_file():
        return {}
    try:
        cache = json.loads(path.read_text())
    except ValueError:  # a torn write: hash again
        return {}
    return cache if isinstance(cache, dict) else {}


def _write_cache(path: Path, cache: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(cache, indent=1))
    os.replace(tmp, path)
