"""Build the draft's training corpus from local, permissively licensed files.

    python -m train.build_corpus --out /work/data/smollm2_corpus [--max-mb N]
    python -m train.build_corpus --broad --out /work/data/broad_corpus [--gzip] [--count-tokens]
        [--site-packages DIR ...] [--source-share 0.25] [--group-share 0.1] [--max-mb N]

Sources (DATA.md has the licences and the exact commands):
- python-stdlib: the `.py` files of the running Python's standard library (PSF-2.0);
- python-docs: the reStructuredText sources of the Python documentation from Debian's `python3-doc`
  package, `/usr/share/doc/python3-doc/html/_sources/**/*.rst.txt` (PSF-2.0, code examples 0BSD);
  left out with a note when the package is not installed;
- with --broad, also those of train/corpus_sources.py: permissive Python distributions (code and
  prose), Node packages, the Python C headers and a few Debian packages (Go, Rust, C, manuals).

Held-out split: a document goes to `eval` when the first 8 bytes of sha256("<source>/<path>"), read
as a big-endian integer, are below `eval_percent` modulo 100 (10 for code, 20 for docs: the docs are
few, and the summarisation set needs 20 long held-out ones); everything else is `train`. Training
documents whose content is byte-identical to a held-out one are dropped, so no held-out text is
trained on; in the broad corpus so are exact copies of an earlier training document. The training
documents are shuffled with a fixed seed, then capped (--source-share: no source above that share of
the training bytes; --group-share: no distribution / package above that share of its source) and cut
to --max-mb, so the output is the same on every run over the same files.

Layout (point `train.run --data` at OUT/train only; the eval sets come from the same split):
    OUT/train/train-00000.jsonl[.gz] ...  {"text", "source", "license", "path"[, "domain"]} per line
    OUT/eval/eval-00000.jsonl[.gz] ...    the held-out documents, same fields
    OUT/manifest.json                     counts, sizes, tokens, the split rule and the sources
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import random
import sys
import sysconfig
from collections import defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path

from longspec_jax.errors import UserError
from train.corpus_documents import Document, Source, split_of

DEBIAN_DOCS_DIR = Path("/usr/share/doc/python3-doc/html/_sources")
SHARD_MB = 16  # shards small enough to copy and to read one at a time
SEED = 0
PSF_LICENSE = "PSF-2.0"
DOCS_LICENSE = "PSF-2.0 (code examples also 0BSD)"
# pydoc_data/topics.py is generated from the documentation: training on it would leak held-out docs.
STDLIB_EXCLUDE = ("site-packages", "__pycache__", "pydoc_data/topics.py")
BROAD_SOURCE_SHARE = 0.25
BROAD_GROUP_SHARE = 0.1

__all__ = ["Document", "Source", "build_corpus", "default_sources", "held_out_documents", "split_of"]


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


def broad_default_sources(
    stdlib_dir: Path | None = None, docs_dir: Path | None = None, site_packages: list[Path] | None = None
) -> tuple[list, list[str]]:
    """(sources, notes) of the broad corpus: the standard library and docs (with domains) and every
    source of train/corpus_sources.py found on this machine."""
    from train.corpus_sources import broad_sources

    stdlib = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    sources: list = [
        Source("python-stdlib", stdlib, "**/*.py", PSF_LICENSE, "code", 10, STDLIB_EXCLUDE, domain="code/python")
    ]
    notes = []
    docs = Path(docs_dir or DEBIAN_DOCS_DIR)
    if docs.is_dir():
        sources.append(Source("python-docs", docs, "**/*.rst.txt", DOCS_LICENSE, "doc", 20, domain="prose/docs"))
    else:
        notes.append(f"no Python docs at {docs} (apt-get install python3-doc): left out")
    more, more_notes = broad_sources(site_packages)
    return sources + more, notes + more_notes


def read_documents(source, skipped: list[str] | None = None) -> Iterator[Document]:
    """The source's documents (see `Source.documents`)."""
    return source.documents(skipped)


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8")).digest()


def split_documents(
    sources: Iterable, skipped: list[str] | None = None, duplicates: list[str] | None = None, dedupe: bool = False
) -> tuple[list[Document], list[Document]]:
    """(train, eval) documents of all sources, each list in source order, then file order; training
    copies of held-out texts, and with `dedupe` of earlier training texts, are removed (their keys
    appended to `duplicates`)."""
    train, held_out = [], []
    for source in sources:
        for doc in read_documents(source, skipped):
            (held_out if split_of(doc.key, source.eval_percent) == "eval" else train).append(doc)
    seen = {_digest(d.text) for d in held_out}
    kept = []
    for doc in train:
        digest = _digest(doc.text)
        if digest in seen:
            if duplicates is not None:
                duplicates.append(doc.key)
            continue
        if dedupe:
            seen.add(digest)
        kept.append(doc)
    return kept, held_out


def held_out_documents(sources: Iterable, kind: str) -> list[Document]:
    """The held-out documents of one kind ("code" / "doc"): what the evaluation sets are built from."""
    return [d for d in split_documents(sources)[1] if d.kind == kind]


def share_cap(sizes: dict[str, int], share: float) -> float:
    """The largest cap c with c <= share * sum(min(size, c)): capped at c, no key holds more than
    `share` of the capped total. Infinite when nothing needs capping or the keys are too few
    (share * len(sizes) <= 1) for any cap to help."""
    total = sum(sizes.values())
    if not sizes or share * len(sizes) <= 1 or max(sizes.values()) <= share * total:
        return float("inf")
    lo, hi = 0.0, float(max(sizes.values()))
    for _ in range(60):
        mid = (lo + hi) / 2
        if mid <= share * sum(min(s, mid) for s in sizes.values()):
            lo = mid
        else:
            hi = mid
    return lo


def cap_shares(docs: list[Document], key, share: float | None) -> list[Document]:
    """Documents (in their order) kept while each key(doc)'s bytes stay within its share cap."""
    if share is None:
        return docs
    sizes: dict[str, int] = defaultdict(int)
    for d in docs:
        sizes[key(d)] += len(d.text.encode("utf-8"))
    cap = share_cap(sizes, share)
    used: dict[str, int] = defaultdict(int)
    kept = []
    for d in docs:
        size = len(d.text.encode("utf-8"))
        if used[key(d)] + size <= cap:
            used[key(d)] += size
            kept.append(d)
    return kept


def cap_groups(docs: list[Document], share: float | None) -> list[Document]:
    """Within each source, no group (distribution, package) above `share` of the source's bytes."""
    if share is None:
        return docs
    by_source: dict[str, list[Document]] = defaultdict(list)
    for d in docs:
        by_source[d.source].append(d)
    kept = {id(d) for group in by_source.values() for d in cap_shares(group, lambda d: d.group or d.source, share)}
    return [d for d in docs if id(d) in kept]


def write_shards(docs: list[Document], folder: Path, prefix: str, shard_bytes: int, gz: bool = False) -> list[Path]:
    """jsonl shards of about shard_bytes of text each (a document is never split); with gz,
    gzip-compressed `.jsonl.gz` (no timestamp, so the bytes are reproducible)."""
    folder.mkdir(parents=True, exist_ok=True)
    for stale in [*folder.glob(f"{prefix}-*.jsonl"), *folder.glob(f"{prefix}-*.jsonl.gz")]:
        stale.unlink()
    suffix = ".jsonl.gz" if gz else ".jsonl"
    paths: list[Path] = []
    handle, size = None, 0
    for doc in docs:
        line = json.dumps(doc.record(), ensure_ascii=False) + "\n"
        if handle is None or size >= shard_bytes:
            if handle is not None:
                handle.close()
            paths.append(folder / f"{prefix}-{len(paths):05d}{suffix}")
            handle = gzip.GzipFile(paths[-1], "wb", compresslevel=9, mtime=0) if gz else paths[-1].open("wb")
            size = 0
        handle.write(line.encode("utf-8"))
        size += len(line.encode("utf-8"))
    if handle is not None:
        handle.close()
    return paths


def count_tokens(docs: list[Document], tokenizer, batch: int = 256) -> dict[str, int]:
    """Tokens (no special tokens) per source."""
    counts: dict[str, int] = defaultdict(int)
    for start in range(0, len(docs), batch):
        chunk = docs[start : start + batch]
        ids = tokenizer([d.text for d in chunk], add_special_tokens=False)["input_ids"]
        for d, row in zip(chunk, ids):
            counts[d.source] += len(row)
    return dict(counts)


def _summary(docs: list[Document], tokens: dict[str, int] | None = None) -> dict:
    by_source: dict[str, dict] = {}
    by_domain: dict[str, dict] = {}
    for d in docs:
        entry = by_source.setdefault(d.source, {"documents": 0, "mb": 0.0, "license": d.license})
        entry["documents"] += 1
        entry["mb"] += len(d.text.encode("utf-8")) / 1e6
        if d.license != entry["license"]:
            entry.setdefault("licenses", {entry["license"]})
            entry["licenses"].add(d.license)
        if d.domain is not None:
            dom = by_domain.setdefault(d.domain, {"documents": 0, "mb": 0.0})
            dom["documents"] += 1
            dom["mb"] += len(d.text.encode("utf-8")) / 1e6
    for name, entry in by_source.items():
        entry["mb"] = round(entry["mb"], 3)
        if "licenses" in entry:
            entry["license"], entry["licenses"] = "per document", sorted(entry["licenses"])
        if tokens is not None:
            entry["tokens"] = tokens.get(name, 0)
    summary = {
        "documents": len(docs),
        "mb": round(sum(e["mb"] for e in by_source.values()), 3),
        "by_source": by_source,
    }
    if tokens is not None:
        summary["tokens"] = sum(tokens.values())
    if by_domain:
        summary["by_domain"] = {
            k: {"documents": v["documents"], "mb": round(v["mb"], 3)} for k, v in sorted(by_domain.items())
        }
    return summary


def build_corpus(
    out: str | Path,
    sources: list,
    *,
    max_mb: float | None = None,
    seed: int = SEED,
    shard_mb: float = SHARD_MB,
    source_share: float | None = None,
    group_share: float | None = None,
    gz: bool = False,
    dedupe: bool = False,
    tokenizer=None,
    notes: list[str] | None = None,
) -> dict:
    """Write the train / eval shards and the manifest under `out`; returns the manifest.
    dedupe: also drop exact copies of an earlier training document (the broad corpus; the Python-only
    corpus keeps them, as it always has). tokenizer: when given, the manifest counts tokens per source."""
    if not sources:
        raise UserError("no corpus sources: pass --stdlib-dir (and --docs-dir) pointing at local files")
    out = Path(out)
    skipped: list[str] = []
    duplicates: list[str] = []
    train, held_out = split_documents(sources, skipped, duplicates, dedupe)
    if not train:
        raise UserError("the sources hold no training documents: check --stdlib-dir / --docs-dir")
    random.Random(seed).shuffle(train)
    before_caps = len(train)
    train = cap_shares(cap_groups(train, group_share), lambda d: d.source, source_share)
    dropped_by_caps = before_caps - len(train)
    if max_mb is not None:
        budget, kept = max_mb * 1e6, []
        for doc in train:
            budget -= len(doc.text.encode("utf-8"))
            if budget < 0:
                break
            kept.append(doc)
        train = kept
    shard_bytes = int(shard_mb * 1e6)
    train_files = write_shards(train, out / "train", "train", shard_bytes, gz)
    eval_files = write_shards(held_out, out / "eval", "eval", shard_bytes, gz)
    train_tokens = count_tokens(train, tokenizer) if tokenizer is not None else None
    eval_tokens = count_tokens(held_out, tokenizer) if tokenizer is not None else None
    manifest = {
        "split_rule": "eval if int.from_bytes(sha256('<source>/<path>')[:8], 'big') % 100 < eval_percent; "
        "train copies of eval texts dropped",
        "seed": seed,
        "max_mb": max_mb,
        "sources": [s.describe() for s in sources],
        "python_version": sys.version.split()[0],
        "train": {**_summary(train, train_tokens), "files": [p.relative_to(out).as_posix() for p in train_files]},
        "eval": {**_summary(held_out, eval_tokens), "files": [p.relative_to(out).as_posix() for p in eval_files]},
        "skipped_not_utf8_or_empty": skipped,
    }
    if dedupe or source_share is not None or group_share is not None or notes:
        manifest.update(
            source_share=source_share,
            group_share=group_share,
            dropped_by_caps=dropped_by_caps,
            duplicates_dropped=duplicates,
            notes=list(notes or []),
        )
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.build_corpus", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path, help="output folder (train/, eval/, manifest.json)")
    p.add_argument("--max-mb", type=float, help="cap on the training text in MB (default: everything)")
    p.add_argument("--stdlib-dir", type=Path, help="Python standard library folder (default: this Python's)")
    p.add_argument("--docs-dir", type=Path, help=f"Python docs reST sources (default: {DEBIAN_DOCS_DIR})")
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--broad", action="store_true", help="add every source of train/corpus_sources.py found here")
    p.add_argument(
        "--site-packages", type=Path, action="append", help="--broad: read distributions here (default: sys.path)"
    )
    p.add_argument(
        "--source-share", type=float, help=f"largest share of one source (--broad default {BROAD_SOURCE_SHARE})"
    )
    p.add_argument(
        "--group-share",
        type=float,
        help=f"largest share of one package in its source (--broad default {BROAD_GROUP_SHARE})",
    )
    p.add_argument("--gzip", action="store_true", help="write .jsonl.gz shards (the trainer reads them as they are)")
    p.add_argument("--count-tokens", action="store_true", help="count SmolLM2 tokens per source (slow on big corpora)")
    p.add_argument("--tokenizer", help="--count-tokens with this HF directory or .gguf (default: embedded SmolLM2)")
    args = p.parse_args(argv)
    try:
        notes: list[str] = []
        if args.broad:
            sources, notes = broad_default_sources(args.stdlib_dir, args.docs_dir, args.site_packages)
            source_share = BROAD_SOURCE_SHARE if args.source_share is None else args.source_share
            group_share = BROAD_GROUP_SHARE if args.group_share is None else args.group_share
        else:
            sources, source_share, group_share = (
                default_sources(args.stdlib_dir, args.docs_dir),
                args.source_share,
                args.group_share,
            )
        tokenizer = None
        if args.count_tokens:
            from longspec_jax.embedded import smollm2_gguf_path
            from longspec_jax.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(Path(args.tokenizer) if args.tokenizer else smollm2_gguf_path())
        manifest = build_corpus(
            args.out,
            sources,
            max_mb=args.max_mb,
            seed=args.seed,
            source_share=source_share,
            group_share=group_share,
            gz=args.gzip,
            dedupe=args.broad,
            tokenizer=tokenizer,
            notes=notes,
        )
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for split in ("train", "eval"):
        tokens = f", {manifest[split]['tokens'] / 1e6:.1f} M tokens" if "tokens" in manifest[split] else ""
        print(
            f"{split}: {manifest[split]['documents']} documents, {manifest[split]['mb']:.1f} MB{tokens}, "
            f"{len(manifest[split]['files'])} shard(s) in {args.out / split}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
