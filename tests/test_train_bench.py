"""`python -m train.bench_train --small`: the GPU training benchmark's CPU smoke test (2 fake devices),
which must run without grain or datasets (the GPU machine has neither)."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

SCRIPT = """
import sys
from train import bench_train
bench_train.main(["--small", "--steps", "1"])
print("data modules imported:", sorted(m for m in ("grain", "datasets") if m in sys.modules))
"""


def test_bench_small_runs_one_and_two_devices_without_the_data_stack():
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines[-1] == "data modules imported: []"
    rows = [line.split("|")[1:-1] for line in lines if line.startswith("| 32 ")]
    assert [int(r[1]) for r in rows] == [1, 2]  # seq 32 on 1 and on 2 devices
    for r in rows:
        assert float(r[4]) > 0  # tokens/s
    assert rows[1][-1].strip().endswith("x")  # the 2-device row carries its scaling ratio
