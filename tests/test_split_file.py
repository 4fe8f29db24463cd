"""tools/split_file.py: a file cut into parts comes back byte for byte, and a wrong set of parts is refused."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "tools" / "split_file.py"


@pytest.fixture(scope="module")
def split_file():
    spec = importlib.util.spec_from_file_location("split_file", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_split_then_join_restores_the_file(split_file, tmp_path, capsys):
    source = tmp_path / "model.gguf"
    source.write_bytes(os.urandom(100_003))  # not a multiple of the part count
    assert split_file.main(["split", str(source), "--parts", "3", "--out-dir", str(tmp_path / "parts")]) == 0
    parts = sorted((tmp_path / "parts").glob("model.gguf.part*"))
    assert [p.name for p in parts] == [f"model.gguf.part{i}of3" for i in (1, 2, 3)]
    assert sum(p.stat().st_size for p in parts) == 100_003 and max(p.stat().st_size for p in parts) == 33_335
    capsys.readouterr()
    assert split_file.main(["join", str(tmp_path / "parts" / "model.gguf.sha256")]) == 0
    joined = tmp_path / "parts" / "model.gguf"
    assert capsys.readouterr().out.strip() == str(joined)
    assert joined.read_bytes() == source.read_bytes()


def test_join_refuses_missing_mixed_or_foreign_parts(split_file, tmp_path, capsys):
    source = tmp_path / "data.bin"
    source.write_bytes(bytes(range(256)) * 40)
    out = tmp_path / "out"
    split_file.split(source, 4, out)
    checksum = out / "data.bin.sha256"

    (out / "data.bin.part3of4").rename(tmp_path / "aside")
    assert split_file.main(["join", str(checksum)]) == 2
    assert "lacks data.bin.part3of4" in capsys.readouterr().err
    (tmp_path / "aside").rename(out / "data.bin.part3of4")

    (out / "data.bin.part1of2").write_bytes(b"from another split")
    with pytest.raises(split_file.SplitError, match=r"splits into \[2, 4\] parts"):
        split_file.join(checksum)
    (out / "data.bin.part1of2").unlink()

    (out / "data.bin.part2of4").write_bytes(b"x" * (out / "data.bin.part2of4").stat().st_size)
    with pytest.raises(split_file.SplitError, match="does not match"):
        split_file.join(checksum, tmp_path / "joined.bin")
    assert not (tmp_path / "joined.bin").exists()


def test_split_of_a_missing_file_is_one_line(split_file, tmp_path, capsys):
    assert split_file.main(["split", str(tmp_path / "absent"), "--parts", "2"]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'absent'} is not a file\n"
