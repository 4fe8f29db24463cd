"""Cut a large file into parts of bounded size and put it back together, checked by its sha256.

    python tools/split_file.py split FILE --parts 3 [--out-dir DIR]
        -> DIR/NAME.part1of3 .. NAME.part3of3 and DIR/NAME.sha256 (DIR defaults to FILE's folder)
    python tools/split_file.py join DIR/NAME.sha256 [--out PATH]
        -> PATH (default DIR/NAME), joined from the parts beside the checksum; removed if it does not match

The checksum file is in `sha256sum` format, so `sha256sum -c` also checks a joined file. Standard
library only: it runs with any Python 3.12, the project need not be installed.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shutil
import sys
from pathlib import Path

CHUNK = 1 << 24


class SplitError(Exception):
    """A mistake in the inputs, reported as one line."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def part_name(name: str, index: int, count: int) -> str:
    return f"{name}.part{index}of{count}"


def split(source: Path, parts: int, out_dir: Path | None = None) -> list[Path]:
    """Writes `parts` pieces of near-equal size and NAME.sha256 into out_dir; returns the pieces."""
    if not source.is_file():
        raise SplitError(f"{source} is not a file")
    if parts < 1:
        raise SplitError(f"--parts {parts} must be >= 1")
    out_dir = out_dir or source.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    part_size = max(1, -(-source.stat().st_size // parts))
    written = []
    with source.open("rb") as f:
        for i in range(1, parts + 1):
            path = out_dir / part_name(source.name, i, parts)
            with path.open("wb") as out:
                left = part_size
                while left and (chunk := f.read(min(CHUNK, left))):
                    out.write(chunk)
                    left -= len(chunk)
            written.append(path)
    (out_dir / f"{source.name}.sha256").write_text(f"{sha256_of(source)}  {source.name}\n")
    return written


def join(checksum: Path, out: Path | None = None) -> Path:
    """Joins the parts named in `checksum`'s folder into `out` and checks the sha256."""
    if not checksum.is_file():
        raise SplitError(f"{checksum} does not exist: `split` writes it beside the parts")
    expected, name = checksum.read_text().split(maxsplit=1)
    name = name.strip().lstrip("*")
    pattern = re.compile(rf"{re.escape(name)}\.part(\d+)of(\d+)")
    found = {m.groups(): p for p in checksum.parent.iterdir() if (m := pattern.fullmatch(p.name))}
    counts = {int(count) for _, count in found}
    if not found:
        raise SplitError(f"no {name}.partNofM beside {checksum}")
    if len(counts) > 1:
        raise SplitError(f"{checksum.parent} holds parts of splits into {sorted(counts)} parts: keep one split")
    count = counts.pop()
    parts = [checksum.parent / part_name(name, i, count) for i in range(1, count + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise SplitError(f"{checksum.parent} lacks {', '.join(missing)}")
    out = out or checksum.parent / name
    with out.open("wb") as joined:
        for part in parts:
            with part.open("rb") as f:
                shutil.copyfileobj(f, joined, CHUNK)
    if sha256_of(out) != expected:
        out.unlink()
        raise SplitError(f"the joined file does not match {checksum}: the parts come from different files")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python tools/split_file.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    cut = sub.add_parser("split", help="cut FILE into --parts pieces and write NAME.sha256")
    cut.add_argument("file", type=Path)
    cut.add_argument("--parts", type=int, required=True)
    cut.add_argument("--out-dir", type=Path, help="where the parts go (default: FILE's folder)")
    put_together = sub.add_parser("join", help="join the parts beside NAME.sha256 and check the sha256")
    put_together.add_argument("checksum", type=Path)
    put_together.add_argument("--out", type=Path, help="the joined file (default: NAME beside the checksum)")
    args = parser.parse_args(argv)
    try:
        if args.command == "split":
            for path in split(args.file, args.parts, args.out_dir):
                print(f"{path} ({path.stat().st_size / 2**20:.1f} MiB)")
        else:
            print(join(args.checksum, args.out))
    except SplitError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
