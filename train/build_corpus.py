"""Build the SmolLM2 draft's training corpus from local, permissively licensed files.

    python -m train.build_corpus --out /work/data/smollm2_corpus [--max-mb N]

Sources (DATA.md has the licences and the exact commands):
- python-stdlib: the `.py` files of the running Python's standard library (PSF-2.0);
- python-docs: the reStructuredText sources of the Python documentation from Debian's `python3-doc`
  package, `/usr/share/doc/python3-doc/html/_sources/**/*.rst.txt` (PSF-2.0, code examples 0BSD);
  left out with a note when the package is not installed.

Held-out split: a document goes to `eval` when the first 8 bytes of sha256("<source>/<path>"), read
as a big-endian integer, are below `eval_percent` modulo 100 (10 for code, 20 for docs: the docs are
few, and the summarisation set needs 20 long held-out ones); everything else is `train`. Training
documents whose content is byte-identical to a held-out one are dropped, so no held-out text is
trained on. The training documents are shuffled with a fixed seed (then cut to --max-mb), so the
output is the same on every run over the same files.

Layout (point `train.run --data` at OUT/train only; the eval sets come from the same split):
    OUT/train/train-00000.jsonl ...   {"text", "source", "license", "path"} per line
    OUT/eval/eval-00000.jsonl ...     the held-out documents, same fields
    OUT/manifest.json                 counts, sizes, the split rule and the sources
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import random
import sys
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path

from longspec_jax.errors import UserError

DEBIAN_DOCS_DIR = Path("/usr/share/doc/python3-doc/html/_sources")
SHARD_MB = 16  # small enough that a shard travels to the GPU machine on its own
SEED = 0
PSF_LICENSE = "PSF-2.0"
DOCS_LICENSE = "PSF-2.0 (code examples also 0BSD)"
# pydoc_data/topics.py is generated from the documentation: training on it would leak held-out docs.
STDLIB_EXCLUDE = ("site-packages", "__pycache__", "pydoc_data/topics.py")


@dataclasses.dataclass(frozen=True)
class Source:
    """One folder of files of one licence. `exclude`: relative paths (or folder names) skipped."""

    name: str
    root: Path
    pattern: str
    license: str
    kind: str  # "code" or "doc": what the eval sets use it for
    eval_percent: int
    exclude: tuple[str, ...] = ()

    def excluded(self, relative: str) -> bool:
        parts = relative.split("/")
        return any(relative == e or relative.startswith(e + "/") or e in parts for e in self.exclude)


@dataclasses.dataclass(frozen=True)
class Document:
    source: str
    license: str
    kind: str
    path: str  # relative to the source root, "/"-separated
    text: str

    @property
    def key(self) -> str:
        return f"{self.source}/{self.path}"

    def record(self) -> dict[str, str]:
        return {"text": self.text, "source": self.source, "license": self.license, "path": self.path}


def split_of(key: str, eval_percent: int) -> str:
    """ "eval" or "train" for a document key "<source>/<relative path>" (the held-out rule)."""
    bucket = int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big") % 100
    return "eval" if bucket < eval_percent else "train"


def default_sources(stdlib_dir: Path | None = None, docs_dir: Path | None = None) -> list[Source]:
    """The standard library of this Python and, when installed, the Debian Python docs."""
    stdlib = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    sources = [Source("python-stdlib", stdlib, "**/*.py", PSF_LICENSE, "code", 10, STDLIB_EXCLUDE)]
    docs = Path(docs_dir or DEBIAN_DOCS_DIR)
    if docs.is_dir():
        sources.append(Source("python-docs", docs, "**/*.rst.txt", DOCS_LICENSE, "doc", 20))
    else:
        print(f"note: no Python docs at {docs} (apt-get install python3-doc); building from code only", file=sys.stderr)
    return sources


def read_documents(source: Source, skipped: list[str] | None = None) -> Iterator[Document]:
    """The source's files in sorted order; files that are not UTF-8 or are blank are skipped
    (their keys appended to `skipped`)."""
    if not source.root.is_dir():
        raise UserError(f"source {source.name}: {source.root} is not a directory: pass the right folder")
    for path in sorted(source.root.glob(source.pattern)):
        relative = path.relative_to(source.root).as_posix()
        if not path.is_file() or source.excluded(relative):
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            text = ""
        if not text.strip():
            if skipped is not None:
                skipped.append(f"{source.name}/{relative}")
            continue
        yield Document(source.name, source.license, source.kind, relative, text)


def split_documents(
    sources: Iterable[Source], skipped: list[str] | None = None
) -> tuple[list[Document], list[Document]]:
    """(train, eval) documents of all sources, each list in sorted key order; training copies of
    held-out texts are removed."""
    train, held_out = [], []
    for source in sources:
        for doc in read_documents(source, skipped):
            (held_out if split_of(doc.key, source.eval_percent) == "eval" else train).append(doc)
    held_out_texts = {hashlib.sha256(d.text.encode("utf-8")).digest() for d in held_out}
    train = [d for d in train if hashlib.sha256(d.text.encode("utf-8")).digest() not in held_out_texts]
    return train, held_out


def held_out_documents(sources: Iterable[Source], kind: str) -> list[Document]:
    """The held-out documents of one kind ("code" / "doc"): what the evaluation sets are built from."""
    return [d for d in split_documents(sources)[1] if d.kind == kind]


def write_shards(docs: list[Document], folder: Path, prefix: str, shard_bytes: int) -> list[Path]:
    """jsonl shards of about shard_bytes each (a document is never split)."""
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob(f"{prefix}-*.jsonl"):
        stale.unlink()
    paths: list[Path] = []
    handle, size = None, 0
    for doc in docs:
        line = json.dumps(doc.record(), ensure_ascii=False) + "\n"
        if handle is None or size >= shard_bytes:
            if handle is not None:
                handle.close()
            paths.append(folder / f"{prefix}-{len(paths):05d}.jsonl")
            handle, size = paths[-1].open("w", encoding="utf-8"), 0
        handle.write(line)
        size += len(line.encode("utf-8"))
    if handle is not None:
        handle.close()
    return paths


def _summary(docs: list[Document]) -> dict:
    by_source: dict[str, dict] = {}
    for d in docs:
        entry = by_source.setdefault(d.source, {"documents": 0, "mb": 0.0, "license": d.license})
        entry["documents"] += 1
        entry["mb"] += len(d.text.encode("utf-8")) / 1e6
    for entry in by_source.values():
        entry["mb"] = round(entry["mb"], 3)
    return {"documents": len(docs), "mb": round(sum(e["mb"] for e in by_source.values()), 3), "by_source": by_source}


def build_corpus(
    out: str | Path, sources: list[Source], *, max_mb: float | None = None, seed: int = SEED, shard_mb: float = SHARD_MB
) -> dict:
    """Write the train / eval shards and the manifest under `out`; returns the manifest."""
    if not sources:
        raise UserError("no corpus sources: pass --stdlib-dir (and --docs-dir) pointing at local files")
    out = Path(out)
    skipped: list[str] = []
    train, held_out = split_documents(sources, skipped)
    if not train:
        raise UserError("the sources hold no training documents: check --stdlib-dir / --docs-dir")
    random.Random(seed).shuffle(train)
    if max_mb is not None:
        budget, kept = max_mb * 1e6, []
        for doc in train:
            budget -= len(doc.text.encode("utf-8"))
            if budget < 0:
                break
            kept.append(doc)
        train = kept
    shard_bytes = int(shard_mb * 1e6)
    train_files = write_shards(train, out / "train", "train", shard_bytes)
    eval_files = write_shards(held_out, out / "eval", "eval", shard_bytes)
    manifest = {
        "split_rule": "eval if int.from_bytes(sha256('<source>/<path>')[:8], 'big') % 100 < eval_percent; "
        "train copies of eval texts dropped",
        "seed": seed,
        "max_mb": max_mb,
        "sources": [
            {
                "name": s.name,
                "root": str(s.root),
                "pattern": s.pattern,
                "license": s.license,
                "kind": s.kind,
                "eval_percent": s.eval_percent,
                "exclude": list(s.exclude),
            }
            for s in sources
        ],
        "python_version": sys.version.split()[0],
        "train": {**_summary(train), "files": [p.relative_to(out).as_posix() for p in train_files]},
        "eval": {**_summary(held_out), "files": [p.relative_to(out).as_posix() for p in eval_files]},
        "skipped_not_utf8_or_empty": skipped,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.build_corpus", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path, help="output folder (train/, eval/, manifest.json)")
    p.add_argument("--max-mb", type=float, help="cap on the training text in MB (default: everything)")
    p.add_argument("--stdlib-dir", type=Path, help="Python standard library folder (default: this Python's)")
    p.add_argument("--docs-dir", type=Path, help=f"Python docs reST sources (default: {DEBIAN_DOCS_DIR})")
    p.add_argument("--seed", type=int, default=SEED)
    args = p.parse_args(argv)
    try:
        manifest = build_corpus(
            args.out, default_sources(args.stdlib_dir, args.docs_dir), max_mb=args.max_mb, seed=args.seed
        )
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for split in ("train", "eval"):
        print(
            f"{split}: {manifest[split]['documents']} documents, {manifest[split]['mb']:.1f} MB, "
            f"{len(manifest[split]['files'])} shard(s) in {args.out / split}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
