"""Corpus documents, folder sources and the held-out rule, shared by the corpus and eval-set builders.

A source yields `Document`s: the text with its provenance (source, licence, path) and, for the broad
corpus, its domain ("code/rust", "prose/book", ...). `split_of` is the held-out rule.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import html.parser
import json
from collections.abc import Iterator
from pathlib import Path

from longspec_jax.errors import UserError

# File extension -> code domain (what the eval sets and the manifest group code by).
CODE_DOMAINS = {
    ".py": "code/python",
    ".pyx": "code/python",
    ".c": "code/c-cpp",
    ".h": "code/c-cpp",
    ".cc": "code/c-cpp",
    ".cpp": "code/c-cpp",
    ".cxx": "code/c-cpp",
    ".hh": "code/c-cpp",
    ".hpp": "code/c-cpp",
    ".cu": "code/c-cpp",
    ".cuh": "code/c-cpp",
    ".js": "code/javascript",
    ".mjs": "code/javascript",
    ".cjs": "code/javascript",
    ".ts": "code/typescript",
    ".rs": "code/rust",
    ".go": "code/go",
    ".sh": "code/shell",
    ".bash": "code/shell",
}
# Generated or minified files: a line this long, or this long on average, is not hand-written.
MAX_LINE_CHARS = 1000
MAX_MEAN_LINE_CHARS = 120
MAX_FILE_BYTES = 1_000_000


def code_domain(path: str) -> str | None:
    return CODE_DOMAINS.get(Path(path).suffix.lower())


def looks_generated(text: str) -> bool:
    """Minified bundles, data tables and other machine-made files (kept out of the broad corpus)."""
    lines = text.splitlines() or [""]
    return (
        len(text) > MAX_FILE_BYTES
        or max(map(len, lines)) > MAX_LINE_CHARS
        or len(text) / len(lines) > MAX_MEAN_LINE_CHARS
    )


@dataclasses.dataclass(frozen=True)
class Document:
    source: str
    license: str
    kind: str  # "code" or "doc": what the eval sets use it for
    path: str  # relative to the source root, "/"-separated
    text: str
    domain: str | None = None  # broad corpus only: "code/<language>" or "prose/<kind>"
    group: str = ""  # what a per-group cap counts (a distribution, a package); "" = the source

    @property
    def key(self) -> str:
        return f"{self.source}/{self.path}"

    def record(self) -> dict[str, str]:
        record = {"text": self.text, "source": self.source, "license": self.license, "path": self.path}
        if self.domain is not None:
            record["domain"] = self.domain
        return record


def split_of(key: str, eval_percent: int) -> str:
    """ "eval" or "train" for a document key "<source>/<relative path>" (the held-out rule)."""
    bucket = int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big") % 100
    return "eval" if bucket < eval_percent else "train"


class _HTMLText(html.parser.HTMLParser):
    """The visible text of an HTML page, one block element per paragraph."""

    BLOCKS = {"p", "div", "h1", "h2", "h3", "h4", "h5", "h6", "li", "pre", "tr", "table", "blockquote", "dt", "dd"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.hidden = 0

    def handle_starttag(self, tag, attrs):
        if tag in ("script", "style", "head"):
            self.hidden += 1
        elif tag in self.BLOCKS or tag == "br":
            self.parts.append("\n\n" if tag in self.BLOCKS else "\n")

    def handle_endtag(self, tag):
        if tag in ("script", "style", "head"):
            self.hidden = max(0, self.hidden - 1)
        elif tag in self.BLOCKS:
            self.parts.append("\n\n")

    def handle_data(self, data):
        if not self.hidden:
            self.parts.append(data)


def html_to_text(page: str) -> str:
    parser = _HTMLText()
    parser.feed(page)
    paragraphs = ("".join(parser.parts)).split("\n\n")
    return "\n\n".join(p.strip() for p in paragraphs if p.strip()) + "\n"


def read_text(path: Path) -> str:
    """The file's UTF-8 text, "" when it is not UTF-8."""
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return ""


@dataclasses.dataclass(frozen=True)
class Source:
    """One folder of files of one licence. `exclude`: relative paths (or folder names) skipped.

    Broad-corpus options: `domain` ("code": by file extension, else a fixed "prose/<kind>"; None:
    records carry no domain, as in the Python-only corpus), `extra_patterns`, `html` (pages reduced
    to their text), `skip_generated` (minified / machine-made files left out) and `package` (the
    Debian package the folder comes from, for the manifest)."""

    name: str
    root: Path
    pattern: str
    license: str
    kind: str  # "code" or "doc": what the eval sets use it for
    eval_percent: int
    exclude: tuple[str, ...] = ()
    domain: str | None = None
    extra_patterns: tuple[str, ...] = ()
    html: bool = False
    skip_generated: bool = False
    package: str | None = None

    def excluded(self, relative: str) -> bool:
        parts = relative.split("/")
        return any(relative == e or relative.startswith(e + "/") or e in parts for e in self.exclude)

    def documents(self, skipped: list[str] | None = None) -> Iterator[Document]:
        """The source's files in sorted order; files that are not UTF-8 or are blank (and, with
        skip_generated, machine-made ones) are skipped, their keys appended to `skipped`."""
        if not self.root.is_dir():
            raise UserError(f"source {self.name}: {self.root} is not a directory: pass the right folder")
        paths = {p for pattern in (self.pattern, *self.extra_patterns) for p in self.root.glob(pattern)}
        for path in sorted(paths):
            relative = path.relative_to(self.root).as_posix()
            if not path.is_file() or self.excluded(relative):
                continue
            text = read_text(path)
            if self.html and text:
                text = html_to_text(text)
            if not text.strip() or (self.skip_generated and looks_generated(text)):
                if skipped is not None:
                    skipped.append(f"{self.name}/{relative}")
                continue
            domain = code_domain(relative) if self.domain == "code" else self.domain
            yield Document(self.name, self.license, self.kind, relative, text, domain, self.name)

    def describe(self) -> dict:
        info = {
            "name": self.name,
            "root": str(self.root),
            "pattern": self.pattern,
            "license": self.license,
            "kind": self.kind,
            "eval_percent": self.eval_percent,
            "exclude": list(self.exclude),
        }
        if self.domain is not None:
            info.update(domain=self.domain, extra_patterns=list(self.extra_patterns), package=self.package)
        return info


def read_split(folder: str | Path) -> list[Document]:
    """The documents of a built corpus split (OUT/train or OUT/eval, `.jsonl` or `.jsonl.gz` shards);
    kind "code" for code domains and sources of code, else "doc"."""
    folder = Path(folder)
    files = sorted([*folder.glob("*.jsonl"), *folder.glob("*.jsonl.gz")])
    if not files:
        raise UserError(
            f"{folder} holds no .jsonl shards: build the corpus with `python -m train.build_corpus --broad`"
        )
    docs = []
    for path in files:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as f:
            for line in f:
                r = json.loads(line)
                domain = r.get("domain")
                kind = "code" if (domain or code_domain(r["path"]) or "").startswith("code/") else "doc"
                docs.append(Document(r["source"], r["license"], kind, r["path"], r["text"], domain, r["source"]))
    return docs
