"""The project's cache folder, and JAX's persistent compilation cache inside it.

One root holds everything the project caches between runs: `$LONGSPEC_CACHE` if set, else
`~/.cache/longspec_jax`. Compiled XLA programs go to `<root>/xla` (the GGUF conversions of
`gguf_cache` to `<root>/gguf_tensors` and `<root>/gguf_tokenizer`). With the cache on, a second run
of the same shapes loads its programs from disk instead of compiling them again; that covers
programs compiled ahead of time with `jitted.lower(*args).compile()` too (`generation.compiled`).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import jax

CACHE_ENV = "LONGSPEC_CACHE"
XLA_SUBDIR = "xla"
_warned: set[Path] = set()  # folders already reported unwritable in this process


def cache_root() -> Path:
    """`$LONGSPEC_CACHE`, else `~/.cache/longspec_jax`."""
    configured = os.environ.get(CACHE_ENV)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "longspec_jax"


def keep_json(folder: Path | None, key: str, payload: dict) -> None:
    """Write payload to folder/key.json through a temporary file (a reader never sees half a file);
    a folder that cannot be written is passed over (what is kept there only saves work)."""
    if folder is None:
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f"{key}.json.tmp"
        tmp.write_text(json.dumps(payload, indent=1, default=str))
        tmp.replace(folder / f"{key}.json")
    except OSError:
        pass


def _writable_folder(path: Path) -> str | None:
    """None if `path` can be created and written, else why not."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path):
            pass
    except OSError as e:
        return e.strerror or str(e)
    return None


def enable_compile_cache() -> Path | None:
    """Turns on JAX's persistent compilation cache under `<cache_root()>/xla`; returns the folder.

    Safe to call more than once. A cache folder set otherwise (`JAX_COMPILATION_CACHE_DIR`) is kept
    and returned. A folder that cannot be written costs a one-line warning on stderr (once per
    process) and the run goes on without a cache (None).
    """
    configured = jax.config.jax_compilation_cache_dir
    if configured:
        return Path(configured)
    folder = cache_root() / XLA_SUBDIR
    problem = _writable_folder(folder)
    if problem:
        if folder not in _warned:
            _warned.add(folder)
            print(
                f"warning: compilation cache off: cannot write {folder} ({problem}); "
                f"set {CACHE_ENV} to a writable folder",
                file=sys.stderr,
            )
        return None
    # Every program counts: the small per-step programs of a decode are many, and each one's compile
    # time adds up at start-up. JAX's defaults skip programs compiled in under a second.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    return folder
