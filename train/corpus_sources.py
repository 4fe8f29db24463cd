"""The broad corpus's sources: installed Python distributions, installed Node packages and a few
Debian packages, each document with its licence. Discovered on the machine that runs the builder,
so the same code gathers more where more is installed; an absent source is skipped with a note.

- python-packages-<code|prose>: every distribution importlib.metadata finds (or those under
  --site-packages) whose metadata licence is permissive (train/corpus_licenses.py); code files by
  extension (Python, C/C++, JavaScript, shell, ...) and prose (the package description, README and
  other .md/.rst files);
- node-packages: /usr/share/nodejs/<pkg>, licence from each package.json's SPDX `license`;
- the Debian packages of DEBIAN_SOURCES: licences read from /usr/share/doc/<pkg>/copyright by hand
  (DATA.md), the parts under other licences excluded by path.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from train.corpus_documents import Document, Source, code_domain, looks_generated, read_text
from train.corpus_licenses import debian_copyright_licenses, distribution_license, spdx_permissive

PROSE_SUFFIXES = (".md", ".rst")
NOT_TEXT_NAMES = ("license", "licence", "copying", "notice", "authors", "changelog", "changes", "history")
SELF = {"longspec-jax", "longspec_jax"}  # this project: its files are not training data
NODE_ROOT = Path("/usr/share/nodejs")
# The Rust books of rust-src's src/doc, by kind of prose: narrative tutorials and reference manuals.
# (Their older editions and print copies sit outside <book>/src and are not read.)
TUTORIAL_BOOKS = ("nomicon", "rust-by-example", "edition-guide", "embedded-book")
REFERENCE_BOOKS = ("rustc", "rustdoc", "unstable-book", "rustc-dev-guide")


def _normalise(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _prose_file(relative: str) -> bool:
    name = Path(relative).name.lower()
    return name.endswith(PROSE_SUFFIXES) and not name.startswith(NOT_TEXT_NAMES)


@dataclasses.dataclass
class PythonPackages:
    """Files of the permissively licensed Python distributions found on `paths` (None: sys.path).
    kind "code": code files by extension; kind "doc": descriptions, READMEs and .md/.rst files."""

    name: str
    kind: str
    eval_percent: int
    paths: tuple[str, ...] | None = None
    kept: dict[str, str] = dataclasses.field(default_factory=dict)  # distribution -> licence
    left_out: dict[str, str] = dataclasses.field(default_factory=dict)  # distribution -> why

    def distributions(self) -> Iterator[tuple[str, str, importlib.metadata.Distribution]]:
        """(name, licence, distribution) of each permissive distribution, once each, sorted by name."""
        found = (
            importlib.metadata.distributions(path=list(self.paths))
            if self.paths
            else importlib.metadata.distributions()
        )
        seen: dict[str, importlib.metadata.Distribution] = {}
        for dist in found:
            name = dist.metadata.get("Name")
            if name and _normalise(name) not in seen:
                seen[_normalise(name)] = dist
        for key in sorted(seen):
            dist = seen[key]
            name = dist.metadata["Name"]
            if key in SELF:
                continue
            license_label, reason = distribution_license(dist.metadata)
            if license_label is None:
                self.left_out[name] = reason
                continue
            if not dist.files:
                self.left_out[name] = "no file list (RECORD) to read"
                continue
            self.kept[name] = license_label
            yield name, license_label, dist

    def documents(self, skipped: list[str] | None = None) -> Iterator[Document]:
        for name, license_label, dist in self.distributions():
            if self.kind == "doc":
                description = dist.metadata.get_payload() or dist.metadata.get("Description") or ""
                if len(description.strip()) > 200:
                    yield Document(
                        self.name, license_label, "doc", f"{name}/DESCRIPTION", description, "prose/readme", name
                    )
            for file in sorted(dist.files, key=str):
                relative = file.as_posix()
                if ".dist-info/" in relative or relative.startswith(".."):
                    continue
                if self.kind == "code":
                    domain = code_domain(relative)
                elif _prose_file(relative):
                    domain = "prose/readme" if Path(relative).name.lower().startswith("readme") else "prose/docs"
                else:
                    domain = None
                if domain is None:
                    continue
                path = Path(dist.locate_file(file))
                text = read_text(path) if path.is_file() else ""
                if not text.strip() or looks_generated(text):
                    if skipped is not None:
                        skipped.append(f"{self.name}/{name}/{relative}")
                    continue
                yield Document(self.name, license_label, self.kind, f"{name}/{relative}", text, domain, name)

    def describe(self) -> dict:
        return {
            "name": self.name,
            "kind": self.kind,
            "eval_percent": self.eval_percent,
            "paths": list(self.paths) if self.paths else "sys.path",
            "distributions": dict(self.kept),
            "left_out": dict(self.left_out),
        }


@dataclasses.dataclass
class NodePackages:
    """JavaScript / TypeScript files of the packages under `root` whose package.json names a
    permissive SPDX licence (Debian installs them there)."""

    name: str
    root: Path
    eval_percent: int
    kind: str = "code"
    kept: dict[str, str] = dataclasses.field(default_factory=dict)
    left_out: dict[str, str] = dataclasses.field(default_factory=dict)

    def documents(self, skipped: list[str] | None = None) -> Iterator[Document]:
        for manifest in sorted(self.root.glob("*/package.json")) + sorted(self.root.glob("@*/*/package.json")):
            package_dir = manifest.parent
            package = package_dir.relative_to(self.root).as_posix()
            try:
                license_field = json.loads(manifest.read_text(encoding="utf-8")).get("license")
            except (json.JSONDecodeError, UnicodeDecodeError):
                license_field = None
            if not isinstance(license_field, str) or not spdx_permissive(license_field):
                self.left_out[package] = f"package.json license {license_field!r}"
                continue
            self.kept[package] = license_field
            for path in sorted(package_dir.rglob("*")):
                relative = path.relative_to(self.root).as_posix()
                domain = code_domain(relative)
                if domain not in ("code/javascript", "code/typescript") or "node_modules" in relative:
                    continue
                if relative.endswith((".min.js", ".d.ts")) or not path.is_file():
                    continue
                text = read_text(path)
                if not text.strip() or looks_generated(text):
                    if skipped is not None:
                        skipped.append(f"{self.name}/{relative}")
                    continue
                yield Document(self.name, license_field, "code", relative, text, domain, package)

    def describe(self) -> dict:
        return {
            "name": self.name,
            "root": str(self.root),
            "kind": self.kind,
            "eval_percent": self.eval_percent,
            "packages": dict(self.kept),
            "left_out": dict(self.left_out),
        }


def _newest(pattern: str) -> Path | None:
    """The last match of a glob in version order (go-1.19 before go-1.21), None when absent."""

    def version(path: Path) -> tuple:
        digits = "".join(c if c.isdigit() else " " for c in path.as_posix())
        return tuple(int(d) for d in digits.split())

    matches = sorted(Path("/").glob(pattern.lstrip("/")), key=version)
    return matches[-1] if matches else None


def debian_sources() -> list[tuple[str, Source | None]]:
    """(package, source or None when not installed) for the Debian packages used. The licences come
    from each package's copyright file; the files it lists under other licences are excluded."""
    go_root = _newest("/usr/share/go-*/src")
    rust_root = _newest("/usr/src/rustc-*")
    go_package = f"golang-{go_root.parent.name.removeprefix('go-')}-src" if go_root else "golang-1.19-src"
    table = [
        (
            go_package,
            go_root,
            lambda root: Source(
                "debian-go",
                root,
                "**/*.go",
                "BSD-3-Clause (Go)",
                "code",
                10,
                # idct.go is under an MPEG licence; testdata holds third-party fixtures (some no-derivatives).
                exclude=("testdata", "image/jpeg/idct.go", "vendor"),
                domain="code",
                extra_patterns=("**/*.bash", "**/*.sh"),
                skip_generated=True,
                package=go_package,
            ),
        ),
        (
            "rust-src",
            rust_root,
            lambda root: Source(
                "debian-rust",
                root,
                "library/**/*.rs",
                "MIT OR Apache-2.0",
                "code",
                10,
                exclude=("tests", "benches"),
                domain="code",
                extra_patterns=("compiler/**/*.rs", "src/ci/**/*.sh"),
                skip_generated=True,
                package="rust-src",
            ),
        ),
        (
            "rust-src",
            rust_root / "src/doc" if rust_root else None,
            lambda root: Source(
                "debian-rust-books",
                root,
                "book/src/**/*.md",
                "MIT OR Apache-2.0",
                "doc",
                20,
                exclude=("SUMMARY.md",),
                domain="prose/book",
                extra_patterns=tuple(f"{b}/src/**/*.md" for b in TUTORIAL_BOOKS),
                package="rust-src",
            ),
        ),
        (
            "rust-src",
            rust_root / "src/doc" if rust_root else None,
            lambda root: Source(
                "debian-rust-reference",
                root,
                "reference/src/**/*.md",
                "MIT OR Apache-2.0",
                "doc",
                20,
                exclude=("SUMMARY.md",),
                domain="prose/reference",
                extra_patterns=tuple(f"{b}/src/**/*.md" for b in REFERENCE_BOOKS),
                package="rust-src",
            ),
        ),
        (
            "libstb-dev",
            Path("/usr/include/stb"),
            lambda root: Source(
                "debian-stb", root, "*.h", "MIT OR public domain (stb)", "code", 10, domain="code", package="libstb-dev"
            ),
        ),
        (
            "sqlite3-doc",
            Path("/usr/share/doc/sqlite3"),
            lambda root: Source(
                "debian-sqlite-docs",
                root,
                "**/*.html",
                "public domain (SQLite)",
                "doc",
                20,
                domain="prose/manual",
                html=True,
                package="sqlite3-doc",
            ),
        ),
    ]
    out = []
    for package, root, make in table:
        installed = root is not None and root.is_dir() and debian_copyright_licenses(package) is not None
        out.append((package, make(root) if installed else None))
    return out


def python_c_headers() -> Source | None:
    include = Path(sysconfig.get_paths()["include"])
    if not include.is_dir():
        return None
    return Source("python-c-headers", include, "**/*.h", "PSF-2.0", "code", 10, domain="code")


def broad_sources(site_packages: list[Path] | None = None, node_root: Path = NODE_ROOT) -> tuple[list, list[str]]:
    """(sources, notes): everything of the broad corpus found on this machine, beyond the Python
    standard library and docs (train.build_corpus adds those)."""
    paths = tuple(str(p) for p in site_packages) if site_packages else None
    sources: list = [
        PythonPackages("python-packages-code", "code", 10, paths),
        PythonPackages("python-packages-prose", "doc", 20, paths),
    ]
    notes = []
    headers = python_c_headers()
    if headers is not None:
        sources.append(headers)
    if node_root.is_dir():
        sources.append(NodePackages("node-packages", node_root, 10))
    else:
        notes.append(f"no Node packages at {node_root} (apt-get install node-lodash node-acorn ...): left out")
    for package, source in debian_sources():
        if source is None:
            notes.append(f"Debian package {package} is not installed (apt-get install {package}): its source left out")
        else:
            sources.append(source)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    return sources, notes
