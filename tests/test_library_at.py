"""tools/library_at.py: a commit's library exported beside the working tree and run in its place."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "library_at.py"


def _tool(*args, cwd=REPO):
    return subprocess.run([sys.executable, str(TOOL), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_a_run_imports_the_exported_library_not_the_working_trees(tmp_path):
    if not (REPO / ".git").exists():
        pytest.fail("the tool exports from the repository's history: run the tests in a clone")
    out = tmp_path / "before"
    done = _tool("export", "HEAD", str(out))
    assert done.returncode == 0, done.stderr
    assert (out / "longspec_jax" / "__init__.py").is_file() and (out / "pallas_kernels" / "__init__.py").is_file()
    drafts = out / "longspec_jax" / "drafts"
    assert drafts.is_symlink() and drafts.resolve() == (REPO / "longspec_jax" / "drafts").resolve()
    assert _tool("export", "HEAD", str(out)).returncode == 0  # a second export replaces the first

    (tmp_path / "probe.py").write_text("import pallas_kernels\nprint('probe', pallas_kernels.__file__)\n")
    ran = _tool("run", str(out), "probe", cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    library, probe = ran.stdout.splitlines()[:2]
    assert library.startswith("library: ") and probe.startswith("probe ")
    assert Path(library.split(" ", 1)[1]).resolve() == (out / "longspec_jax" / "__init__.py").resolve()
    assert Path(probe.split(" ", 1)[1]).resolve() == (out / "pallas_kernels" / "__init__.py").resolve()


def test_bad_inputs_say_what_to_do(tmp_path):
    bad_ref = _tool("export", "no-such-ref", str(tmp_path / "x"))
    assert bad_ref.returncode != 0 and "git archive no-such-ref" in bad_ref.stderr
    empty = _tool("run", str(tmp_path), "probe")
    assert empty.returncode != 0 and "run export first" in empty.stderr
