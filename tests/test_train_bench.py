"""`python -m benchmarks.bench_train`: the GPU training benchmark's CPU smoke test (--small, 2 fake
devices, which must run without grain or datasets: the GPU machine has neither), its saved case
lines and --merge, and the per-case time limit."""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks import bench_train

REPO = Path(__file__).resolve().parent.parent

SCRIPT = """
import sys
from benchmarks import bench_train
bench_train.main(["--small", "--steps", "1", "--out", sys.argv[1]])
print("data modules imported:", sorted(m for m in ("grain", "datasets") if m in sys.modules))
"""


def table_rows(lines):
    return [line.split("|")[1:-1] for line in lines if line.startswith("| 32 ")]


def test_bench_small_runs_one_and_two_devices_and_merge_rebuilds_its_table(tmp_path, capsys):
    saved = tmp_path / "train_32.jsonl"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(saved)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines[-1] == "data modules imported: []"
    # Each case's JSON line comes out before the table, and is the line saved to --out.
    printed = [json.loads(line) for line in lines if line.startswith("{")]
    assert [(r["seq_len"], r["devices"]) for r in printed] == [(32, 1), (32, 2)]
    assert saved.read_text().splitlines() == [line for line in lines if line.startswith("{")]
    assert lines.index(next(line for line in lines if line.startswith("| 32 "))) > max(
        i for i, line in enumerate(lines) if line.startswith("{")
    )
    for r in printed:
        assert r["compile_s"] > 0 and r["build_s"] > 0 and r["warmup_step_s"] > 0 and r["step_s"] > 0
    rows = table_rows(lines)
    assert [int(r[1]) for r in rows] == [1, 2]  # seq 32 on 1 and on 2 devices
    for r in rows:
        assert float(r[4]) > 0  # tokens/s
    assert rows[1][8].strip().endswith("x")  # the 2-device row carries its scaling ratio

    # The table again from the saved lines, each case in its own file as separate calls would save
    # them, listed out of order: the same rows.
    one, two = tmp_path / "train_1gpu.jsonl", tmp_path / "train_2gpu.jsonl"
    one.write_text(json.dumps(printed[0]) + "\n")
    two.write_text("# a note\n" + json.dumps(printed[1]) + "\n")
    assert bench_train.main(["--merge", str(two), str(one)]) == 0
    assert table_rows(capsys.readouterr().out.splitlines()) == rows


def test_a_case_past_its_time_limit_is_killed_and_reported():
    child = "import sys, time; print('# target + draft built', file=sys.stderr, flush=True); time.sleep(60)"
    status, _, stderr = bench_train.run_with_limit([sys.executable, "-c", child], limit_s=3)
    assert status is None and "target + draft built" in stderr
    # A real 7B case with no time to finish: one failed row, saying why.
    args = argparse.Namespace(steps=1, case_timeout=2.0)
    result = bench_train._run_isolated(bench_train.Case(1024, 1, 16), args)
    assert result["error"].startswith("timed out after 2 s") and (result["seq_len"], result["devices"]) == (1024, 1)
    assert "timed out after 2 s" in bench_train.table([result], 989.0)


def test_missing_merge_file_is_a_user_error(tmp_path, capsys):
    assert bench_train.main(["--merge", str(tmp_path / "none.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_random_module_state_matches_the_modules_own_initialiser_in_shape_dtype_and_kind():
    import jax
    import numpy as np
    from flax import nnx

    from longspec_jax.draft import DraftBlock
    from longspec_jax.model import Transformer
    from train import sharding
    from train.configs import tiny

    mesh = sharding.make_mesh((1, -1, 1), jax.devices()[:1])
    for make in (
        lambda: Transformer(tiny.MODEL, dtype="bfloat16", rngs=nnx.Rngs(0)),
        lambda: DraftBlock(tiny.MODEL, rngs=nnx.Rngs(1)),
    ):
        graphdef, state = bench_train._random_module_state(make, mesh)
        ref_graphdef, ref_state = nnx.split(make())
        assert graphdef == ref_graphdef
        drawn, ref = jax.tree_util.tree_leaves_with_path(state), jax.tree.leaves(ref_state)
        assert len(drawn) == len(ref)
        for (path, leaf), want in zip(drawn, ref):
            assert (leaf.shape, leaf.dtype) == (want.shape, want.dtype), jax.tree_util.keystr(path)
            got, want = np.asarray(leaf, np.float32), np.asarray(want, np.float32)
            if want.ndim == 1:  # norm weights 1 and biases 0, as the module makes them
                np.testing.assert_array_equal(got, want)
            else:
                assert abs(got.std() - 0.02) < 0.004 and abs(got.mean()) < 0.004, jax.tree_util.keystr(path)
