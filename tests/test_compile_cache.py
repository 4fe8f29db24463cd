"""The persistent compilation cache: a second process finds what the first compiled (ahead of time,
as `generation.compiled` does), under `$LONGSPEC_CACHE/xla`; an unwritable folder only warns."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Counts JAX's own cache events around one ahead-of-time compile of a small program.
CHILD = """
import json, jax, jax.numpy as jnp
from jax import monitoring
from longspec_jax.compile_cache import enable_compile_cache
events = []
monitoring.register_event_listener(lambda event, **_: events.append(event))
folder = enable_compile_cache()
assert enable_compile_cache() == folder  # a second call changes nothing
jitted = jax.jit(lambda x: jnp.sin(x) * 2.0 + jnp.cumsum(x))
out = jitted.lower(jnp.ones((16,), jnp.float32)).compile()(jnp.arange(16.0))
print(json.dumps({
    "folder": None if folder is None else str(folder),
    "hits": events.count("/jax/compilation_cache/cache_hits"),
    "misses": events.count("/jax/compilation_cache/cache_misses"),
    "sum": float(out.sum()),
}))
"""


def run_child(cache: Path) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env.update(LONGSPEC_CACHE=str(cache), JAX_PLATFORMS="cpu", JAX_ENABLE_COMPILATION_CACHE="true")
    result = subprocess.run(
        [sys.executable, "-c", CHILD], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


def test_second_process_loads_the_program_from_the_cache(tmp_path):
    first, _ = run_child(tmp_path / "cache")
    folder = tmp_path / "cache" / "xla"
    assert first["folder"] == str(folder)
    assert first["hits"] == 0 and first["misses"] >= 1
    entries = [p for p in folder.iterdir() if not p.name.startswith(".")]
    assert entries, "the first process wrote no cache entry"

    second, _ = run_child(tmp_path / "cache")
    assert second["hits"] >= 1 and second["misses"] == 0
    assert second["sum"] == first["sum"]
    assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) == sorted(p.name for p in entries)


def test_unwritable_cache_folder_warns_once_and_runs_without_cache(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    result, stderr = run_child(blocker)
    assert result["folder"] is None and result["hits"] == 0
    warnings = [line for line in stderr.splitlines() if "compilation cache off" in line]
    assert warnings == [
        f"warning: compilation cache off: cannot write {blocker / 'xla'} (Not a directory); "
        "set LONGSPEC_CACHE to a writable folder"
    ]


def test_cache_root_is_shared_with_the_gguf_cache(monkeypatch, tmp_path):
    from longspec_jax import compile_cache, gguf_cache

    monkeypatch.setenv("LONGSPEC_CACHE", str(tmp_path))
    assert compile_cache.cache_root() == gguf_cache.cache_root() == tmp_path
    monkeypatch.delenv("LONGSPEC_CACHE")
    assert compile_cache.cache_root() == gguf_cache.cache_root() == Path.home() / ".cache" / "longspec_jax"
