"""Move the embedded SmolLM2 GGUF (98 MB) to the GPU machine, which takes at most 64 MiB per call
(the working tree, ~12 MiB with the shipped draft, included).

Here:             python -m infer.stage_gguf split        -> .stage/part1..3, .stage/sha256
GPU call N:       (carry .stage/partN .stage/sha256)  python -m infer.stage_gguf put-part N
last call:        ... && python -m infer.stage_gguf join  -> prints /root/stage/SmolLM2-135M-Instruct.gguf
Three parts of ~31 MiB leave room in each call for the wheels or the training corpus.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import sys
from pathlib import Path

from longspec_jax.errors import UserError

LOCAL_DIR = Path(".stage")  # relative to the repository root, git-ignored
REMOTE_DIR = Path("/root/stage")
JOINED_NAME = "SmolLM2-135M-Instruct.gguf"
PARTS = 3


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def split() -> None:
    from longspec_jax.embedded import smollm2_gguf_path

    source = smollm2_gguf_path()
    data = source.read_bytes()
    LOCAL_DIR.mkdir(exist_ok=True)
    part_size = -(-len(data) // PARTS)
    for i in range(PARTS):
        (LOCAL_DIR / f"part{i + 1}").write_bytes(data[i * part_size : (i + 1) * part_size])
    (LOCAL_DIR / "sha256").write_text(f"{hashlib.sha256(data).hexdigest()}  {source.name}\n")
    print(f"{PARTS} parts of {part_size / 2**20:.1f} MiB in {LOCAL_DIR}/ from {source}")


def put_part(n: int) -> None:
    part = LOCAL_DIR / f"part{n}"
    if not part.is_file():
        raise UserError(f"{part} is missing: run `python -m infer.stage_gguf split` here and carry {part}")
    REMOTE_DIR.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(part, REMOTE_DIR / part.name)
    if (LOCAL_DIR / "sha256").is_file():
        shutil.copyfile(LOCAL_DIR / "sha256", REMOTE_DIR / "sha256")
    print(f"{REMOTE_DIR / part.name}")


def join() -> Path:
    checksum = next((p for p in (LOCAL_DIR / "sha256", REMOTE_DIR / "sha256") if p.is_file()), None)
    if checksum is None:
        raise UserError("no sha256 file: carry .stage/sha256 (written by `split`) in a put-part or join call")
    parts = [REMOTE_DIR / f"part{i + 1}" for i in range(PARTS)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise UserError(f"{REMOTE_DIR} lacks {', '.join(missing)}: run `put-part` for each first")
    joined = REMOTE_DIR / JOINED_NAME
    with joined.open("wb") as out:
        for part in parts:
            with part.open("rb") as f:
                shutil.copyfileobj(f, out)
    expected = checksum.read_text().split()[0]
    if sha256_of(joined) != expected:
        joined.unlink()
        raise UserError(f"joined GGUF does not match {checksum}: the parts are from two splits; redo both")
    print(joined)
    return joined


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m infer.stage_gguf", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("split", help=f"cut the installed GGUF into .stage/part1..{PARTS} and write .stage/sha256")
    put = sub.add_parser("put-part", help="copy .stage/partN to /root/stage/ (on the GPU machine)")
    put.add_argument("n", type=int, choices=range(1, PARTS + 1))
    sub.add_parser("join", help="join /root/stage/part* into the GGUF and check its sha256")
    args = parser.parse_args(argv)
    try:
        if args.command == "split":
            split()
        elif args.command == "put-part":
            put_part(args.n)
        else:
            join()
    except UserError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
