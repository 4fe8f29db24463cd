"""Time the library as it was at a commit beside the working tree's, in one process each, on one machine.

    python tools/library_at.py export REF DIR
        -> DIR/longspec_jax and DIR/pallas_kernels as committed at REF (the shipped drafts, data not
           code, linked to the working tree's instead of copied)
    python tools/library_at.py run DIR MODULE [ARGS...]
        -> python -m MODULE ARGS with DIR's library first on the path, the working tree's benchmarks
           and scripts around it; prints "library: PATH" first, so a record says which library ran

Export on a machine with the repository's history, carry DIR with the working tree (it holds only
sources), and run both sides in the same call: `run DIR benchmarks.decode_kernels ...` for the
commit, `python -m benchmarks.decode_kernels ...` for the change. Standard library only; the
exported tree is read-only in spirit: edit the working tree, export again.
"""

from __future__ import annotations

import argparse
import io
import os
import runpy
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

PACKAGES = ("longspec_jax", "pallas_kernels")
DATA = Path("longspec_jax") / "drafts"  # large weights: linked, not exported


def export(ref: str, out: Path, repo: Path) -> None:
    """REF's library sources into out (replacing what an earlier export left there)."""
    archive = subprocess.run(
        ["git", "archive", "--format=tar", ref, *PACKAGES], cwd=repo, capture_output=True, check=False
    )
    if archive.returncode:
        raise SystemExit(f"library_at: git archive {ref}: {archive.stderr.decode().strip()}")
    for name in PACKAGES:
        _remove(out / name)
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        members = [m for m in tar.getmembers() if not Path(m.name).is_relative_to(DATA)]
        tar.extractall(out, members=members, filter="data")
    if (repo / DATA).is_dir():
        (out / DATA).symlink_to(os.path.relpath((repo / DATA).resolve(), (out / DATA).parent.resolve()))


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def run(library: Path, module: str, args: list[str]) -> None:
    """python -m module args, importing the library from `library` and the rest from the cwd."""
    if not all((library / name / "__init__.py").is_file() for name in PACKAGES):
        raise SystemExit(f"library_at: {library} holds no exported library: run export first")
    sys.path[:0] = [str(library.resolve()), os.getcwd()]
    for name in [m for m in sys.modules if m.split(".")[0] in PACKAGES]:
        del sys.modules[name]
    # An editable install finds the working tree's packages before sys.path: take its finders out.
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__.lower()]
    import longspec_jax

    if not Path(longspec_jax.__file__).resolve().is_relative_to(library.resolve()):
        raise SystemExit(f"library_at: imported {longspec_jax.__file__}, not the export in {library}")
    print(f"library: {longspec_jax.__file__}", flush=True)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="REF's library sources into DIR")
    ex.add_argument("ref")
    ex.add_argument("dir", type=Path)
    ex.add_argument("--repo", type=Path, default=Path.cwd(), help="the repository (default: the cwd)")
    ru = sub.add_parser("run", help="python -m MODULE with DIR's library")
    ru.add_argument("dir", type=Path)
    ru.add_argument("module")
    ru.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.command == "export":
        export(args.ref, args.dir, args.repo)
    else:
        run(args.dir, args.module, args.args)


if __name__ == "__main__":
    main()
