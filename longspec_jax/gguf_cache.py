"""On-disk cache of what a GGUF converts to, so only the first load of a GGUF pays the conversion.

For the embedded SmolLM2 the conversion costs about a minute on CPU (transformers building the
tokenizer from the GGUF metadata, the gguf package dequantising the Q4_1 blocks); the cached
artefacts load in a few seconds:
- `gguf_tensors`: one `model.safetensors` with the dequantised float32 tensors and the HF config
  (JSON in the safetensors metadata). float32 because Q4_1 values `d * q + m` (float16 d and m)
  need more mantissa than float16 or bfloat16 holds (every Q4_1 tensor of SmolLM2 has such values):
  storing those would change the weights.
  That is 4 bytes of disk per parameter: 540 MB for SmolLM2, 28 GB for a 7B model; delete an
  entry's folder to reclaim it (the next load converts again).
- `gguf_tokenizer`: the transformers tokenizer as `save_pretrained` writes it (a few MB).

Layout: `<root>/<kind>/<sha256 of the GGUF file>/` holding the artefact files and `manifest.json`
(the converter fingerprint, every file's size and checksum); root is `$LONGSPEC_CACHE`, else
`~/.cache/longspec_jax`.
- The key is the file's content (0.3-0.4 s to hash the 98 MB SmolLM2, once per process), not its
  name+size+mtime: a file replaced by another of the same name and size with the mtime kept
  (`cp -p`, `rsync -a`, archives and wheels that set mtimes) would be served the old file's tensors.
  Copies of one file share an entry.
- The fingerprint is the converting module's source and the converting library's version: an entry
  written by other converter code is stale and rebuilt, so a fixed converter never serves old results.
- Entries are written in a temporary folder beside them and renamed into place, so an interrupted
  write leaves no entry. An entry with files missing, of the wrong size or content, or unreadable is
  rebuilt (with a warning). The content check is an xxh3-128 checksum of every file, verified on
  every use: a damaged byte inside the tensors would otherwise load as a wrong weight and give
  wrong text silently. xxh3 hashes several GB/s (SmolLM2's 540 MB in about 0.1 s on an idle core),
  little next to reading the tensors themselves.
- Failing to write (read-only or full disk) only warns: the converted result is still returned.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import mmap
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from longspec_jax.compile_cache import CACHE_ENV, cache_root

MANIFEST = "manifest.json"
TENSORS_FILE = "model.safetensors"
_CONFIG_KEY = "hf_config"
# Manifests of another layout (older ones listed sizes only) are stale: their entries are rebuilt.
_MANIFEST_FORMAT = 2
# Temporary folders of writes that were killed are removed once surely abandoned (a live write of
# a 7B model's tensors takes minutes, not an hour).
_TEMP_PREFIX = ".tmp-"
_ABANDONED_AFTER_S = 3600

_digests: dict[tuple, str] = {}


def converter_fingerprint(module_file: str, *distributions: str) -> str:
    """Identity of a converter: its module's source and the versions of the libraries it calls."""
    h = hashlib.sha256(Path(module_file).read_bytes())
    for name in distributions:
        h.update(f"\0{name}=={importlib.metadata.version(name)}".encode())
    return h.hexdigest()


def cached_gguf_tensors(
    path: Path, convert: Callable[[], tuple[dict[str, Any], dict[str, np.ndarray]]], fingerprint: str
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """`convert()` (an HF config dict and float32 tensors by name) for the GGUF at `path`, cached."""
    return _cached(path, "gguf_tensors", fingerprint, convert, _save_tensors, _load_tensors)


def cached_gguf_tokenizer(path: Path, convert: Callable[[], Any], fingerprint: str):
    """`convert()` (a transformers tokenizer) for the GGUF at `path`, cached."""
    return _cached(path, "gguf_tokenizer", fingerprint, convert, _save_tokenizer, _load_tokenizer)


def file_sha256(path: Path) -> str:
    """sha256 of a file, hashed once per process while its inode, size, mtime and ctime stay put
    (ctime changes on every write, even one that restores the mtime)."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)
    if key not in _digests:
        with open(path, "rb") as f:
            _digests[key] = hashlib.file_digest(f, "sha256").hexdigest()
    return _digests[key]


def _cached[T](
    path: Path,
    kind: str,
    fingerprint: str,
    convert: Callable[[], T],
    save: Callable[[T, Path], None],
    load: Callable[[Path], T],
) -> T:
    entry = cache_root() / kind / file_sha256(path)
    _remove_abandoned_temporaries(entry.parent)
    problem = _entry_problem(entry, fingerprint)
    if problem is None:
        try:
            return load(entry)
        except Exception as e:  # whatever is broken inside an entry, converting again mends it
            problem = f"it cannot be loaded: {e}"
    if problem not in ("absent", "stale"):
        warnings.warn(f"rebuilding the cache entry {entry} of {path}: {problem}", stacklevel=3)
    value = convert()
    try:
        _store(entry, fingerprint, lambda folder: save(value, folder))
    except OSError as e:
        warnings.warn(
            f"could not cache the conversion of {path} in {entry.parent} ({e}); the next load converts "
            f"again: point {CACHE_ENV} at a writable folder with space to spare",
            stacklevel=3,
        )
    return value


def _entry_problem(entry: Path, fingerprint: str) -> str | None:
    """None for a usable entry, else why not: "absent", "stale" or what is damaged."""
    if not entry.exists():
        return "absent"
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
        if manifest.get("format") != _MANIFEST_FORMAT:
            return "stale"
        files, made_by = dict(manifest["files"]), manifest["fingerprint"]
        expected = {name: (int(f["size"]), str(f["xxh3_128"])) for name, f in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"its manifest is unreadable ({e})"
    if made_by != fingerprint:
        return "stale"
    for name, (size, checksum) in expected.items():
        try:
            actual = (entry / name).stat().st_size
            if actual != size:
                return f"{name} holds {actual} bytes instead of {size}"
            if _checksum(entry / name) != checksum:
                return f"{name} does not match its checksum"
        except OSError:
            return f"{name} is missing or unreadable"
    return None


def _checksum(path: Path) -> str:
    if path.stat().st_size == 0:  # mmap refuses empty files
        return xxhash.xxh3_128(b"").hexdigest()
    # Hashed through a memory map: no copy of the file passes through Python.
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        return xxhash.xxh3_128(mapped).hexdigest()


def _store(entry: Path, fingerprint: str, write: Callable[[Path], None]) -> None:
    entry.parent.mkdir(parents=True, exist_ok=True)
    temp = Path(tempfile.mkdtemp(prefix=_TEMP_PREFIX, dir=entry.parent))
    try:
        # mkdtemp makes it private; an entry is as readable as the cache folder (a shared cache).
        temp.chmod(entry.parent.stat().st_mode & 0o777)
        write(temp)
        files = {
            str(p.relative_to(temp)): {"size": p.stat().st_size, "xxh3_128": _checksum(p)}
            for p in temp.rglob("*")
            if p.is_file()
        }
        manifest = {"format": _MANIFEST_FORMAT, "fingerprint": fingerprint, "files": files}
        # Written last: a folder holding a manifest was completely written.
        (temp / MANIFEST).write_text(json.dumps(manifest))
        if entry.exists():  # stale or damaged: set aside under a temporary name, then dropped
            discarded = temp.with_name(temp.name + "-discarded")
            entry.rename(discarded)
            shutil.rmtree(discarded, ignore_errors=True)
        try:
            temp.rename(entry)
        except OSError:
            if _entry_problem(entry, fingerprint) is not None:
                raise
            # else another process stored the same entry first: theirs is as good as ours.
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def _remove_abandoned_temporaries(folder: Path) -> None:
    if not folder.is_dir():
        return
    now = time.time()
    for temp in folder.glob(_TEMP_PREFIX + "*"):
        try:
            if now - temp.stat().st_mtime > _ABANDONED_AFTER_S:
                shutil.rmtree(temp, ignore_errors=True)
        except OSError:
            pass  # removed meanwhile by another process


def _save_tensors(converted: tuple[dict[str, Any], dict[str, np.ndarray]], folder: Path) -> None:
    from safetensors.numpy import save_file

    config, tensors = converted
    save_file(tensors, folder / TENSORS_FILE, metadata={_CONFIG_KEY: json.dumps(config)})


def _load_tensors(folder: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    from safetensors import safe_open

    with safe_open(folder / TENSORS_FILE, framework="numpy") as f:
        config = json.loads(f.metadata()[_CONFIG_KEY])
        return config, {name: f.get_tensor(name) for name in f.keys()}


def _save_tokenizer(tokenizer, folder: Path) -> None:
    tokenizer.save_pretrained(str(folder))


def _load_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
