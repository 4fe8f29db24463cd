"""benchmarks.tune_head_top_k runs each setting over the head in each format (the kernel interpreted on a CPU)."""

import pytest

from benchmarks import bench_draft_top_k, tune_head_top_k
from benchmarks.floors import Rates


@pytest.fixture(autouse=True)
def fixed_rates(monkeypatch):
    """No 2 GiB copy on the CPU: the floors at a fixed 1 GB/s."""
    monkeypatch.setattr(tune_head_top_k, "measure_rates", lambda: Rates(bandwidth=1e9, matmul=1e15))


def test_every_setting_is_timed_over_the_head_in_each_format(monkeypatch, capsys):
    monkeypatch.setattr(bench_draft_top_k, "ITERATIONS", 1)
    monkeypatch.setattr(tune_head_top_k, "SETTINGS", [(256, None, 3, None), (128, 4, 3, 32)])

    results = tune_head_top_k.main(["--shapes", "300x64", "--rows", "1", "--formats", "int8,bf16"])

    assert [r[2:4] for r in results] == [("int8", 256), ("int8", 128), ("bf16", 256), ("bf16", 128)]
    assert all(isinstance(r[-1], float) and r[-1] > 0 for r in results)
    lines = capsys.readouterr().out.splitlines()
    int8_row = next(line for line in lines if line.startswith("300 1 int8 128 4 3 32 "))
    bf16_row = next(line for line in lines if line.startswith("300 1 bf16 256 None 3 None "))
    # the floors: the int8 head's 300 x 64 bytes and 300 float32 scales, the bf16 head's 2 x 300 x 64
    # bytes, at 1 GB/s; then the time against them
    assert [float(f) for f in int8_row.split()[-2:]] == [20.4, round(results[1][-1] / 20.4, 2)]
    assert [float(f) for f in bf16_row.split()[-2:]] == [38.4, round(results[2][-1] / 38.4, 2)]


def test_settings_and_k_from_the_command_line(monkeypatch, capsys):
    monkeypatch.setattr(bench_draft_top_k, "ITERATIONS", 1)

    results = tune_head_top_k.main(["--shapes", "300x64", "--rows", "2", "--k", "3", "--settings", "128:-:2:32"])

    assert [r[2:7] for r in results] == [("int8", 128, None, 2, 32)]
    assert "300 2 int8 128 None 2 32" in capsys.readouterr().out


def test_a_malformed_setting_names_the_form(monkeypatch):
    with pytest.raises(SystemExit, match="block_vocab:warps:stages:block_h"):
        tune_head_top_k.main(["--settings", "128:4:3"])
    with pytest.raises(SystemExit, match="neither a whole number"):
        tune_head_top_k.main(["--settings", "128:four:3:-"])
    with pytest.raises(SystemExit, match="other than int8 and bf16"):
        tune_head_top_k.main(["--formats", "int4"])


def test_rows_in_noise_groups(monkeypatch, capsys):
    """--groups passes Gumbel noise of that many groups to the kernel; rows that do not split into
    them are refused."""
    monkeypatch.setattr(bench_draft_top_k, "ITERATIONS", 1)
    seen = []
    real = tune_head_top_k.head_top_k
    monkeypatch.setattr(tune_head_top_k, "head_top_k", lambda *a, **kw: seen.append(kw["noise"]) or real(*a, **kw))

    results = tune_head_top_k.main(["--shapes", "300x64", "--rows", "8", "--settings", "128:-:2:32", "--groups", "4"])

    assert len(results) == 1 and isinstance(results[0][-1], float)
    assert {n.shape for n in seen} == {(4, 300)}
    with pytest.raises(SystemExit, match="do not fall into --groups 3"):
        tune_head_top_k.main(["--shapes", "300x64", "--rows", "8", "--groups", "3"])
