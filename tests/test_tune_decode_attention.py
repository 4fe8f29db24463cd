"""benchmarks/tune_decode_attention.py on the CPU (interpret mode): it measures each configuration
it tries and keeps the fastest; a configuration that fails is skipped, not fatal."""

import dataclasses

import pytest

from benchmarks import tune_decode_attention as tune_module
from longspec_jax.model_shapes import MODEL_SHAPES

TINY = dataclasses.replace(MODEL_SHAPES["smollm2_135m"], num_heads=2, num_kv_heads=1, head_dim=64, num_layers=1)


def test_coordinate_descent_keeps_the_fastest_and_skips_what_fails(monkeypatch):
    monkeypatch.setattr(tune_module, "ITERATIONS", 1)
    monkeypatch.setattr(tune_module, "KNOBS", {"block_rows": (16, 32), "num_warps": (3,)})
    times = {None: 5.0, 16: 2.0, 32: 4.0}

    def fake_seconds(config, inputs, layers, knobs):
        if knobs["num_warps"] == 3:
            raise ValueError("num_warps must be a power of two")
        return times[knobs["block_rows"]] * 1e-6

    monkeypatch.setattr(tune_module, "layer_seconds", fake_seconds)
    logged = []
    best, best_us, default_us = tune_module.tune(TINY, 1, 3, 40, 1, log=logged.append)
    assert best["block_rows"] == 16 and best["num_warps"] is None
    assert (best_us, default_us) == (pytest.approx(2.0), pytest.approx(5.0))
    assert any("num_warps" in line and "ValueError" in line for line in logged)


def test_one_configuration_runs_the_kernel_in_a_device_loop(monkeypatch):
    monkeypatch.setattr(tune_module, "ITERATIONS", 1)
    inputs = tune_module.make_inputs(TINY, 1, 3, 40, 64, 1)
    seconds = tune_module.layer_seconds(TINY, inputs, 1, dict(tune_module.DEFAULT))
    assert 0 < seconds < 60


def test_defaults_only_times_the_default_alone(monkeypatch):
    tried = []

    def fake_seconds(config, inputs, layers, knobs):
        tried.append(dict(knobs))
        return 3e-6

    monkeypatch.setattr(tune_module, "layer_seconds", fake_seconds)
    monkeypatch.setattr(tune_module, "make_inputs", lambda *args: None)
    best, best_us, default_us = tune_module.tune(TINY, 1, 3, 40, 1, log=lambda line: None, search=False)
    assert tried == [tune_module.DEFAULT] and best == tune_module.DEFAULT
    assert best_us == default_us == pytest.approx(3.0)


def test_capacity_flag_sizes_the_timed_caches(monkeypatch, capsys):
    capacities = []

    def fake_inputs(config, batch, t, context, capacity, layers):
        capacities.append((context, capacity))

    monkeypatch.setattr(tune_module, "make_inputs", fake_inputs)
    monkeypatch.setattr(tune_module, "layer_seconds", lambda *args: 3e-6)
    argv = ["--batches", "1", "--tree-sizes", "2", "--context", "100", "--layers", "1", "--defaults-only"]
    tune_module.main([*argv, "--capacity", "256"])
    tune_module.main(argv)
    assert capacities == [(100, 256), (100, 612)]
    assert "context 100 of 256 rows" in capsys.readouterr().out


def test_splits_flag_times_each_count_and_the_default_on_the_same_inputs(monkeypatch, capsys):
    made, timed = [], []

    def fake_inputs(config, batch, t, context, capacity, layers):
        made.append((batch, t, capacity))
        return object()

    def fake_seconds(config, inputs, layers, knobs):
        timed.append((inputs, knobs["num_splits"]))
        return (knobs["num_splits"] or 7) * 1e-6

    monkeypatch.setattr(tune_module, "make_inputs", fake_inputs)
    monkeypatch.setattr(tune_module, "layer_seconds", fake_seconds)
    tune_module.main(["--batches", "1", "--tree-sizes", "4,1", "--layers", "1", "--capacity", "256", "--splits", "2,5"])
    assert made == [(1, 4, 256), (1, 1, 256)]
    assert [count for _, count in timed] == [None, 2, 5] * 2
    assert len({id(inputs) for inputs, _ in timed[:3]}) == 1
    out = capsys.readouterr().out
    assert "| 1 | 4 | default | 7.00 |" in out and "| 1 | 1 | 5 | 5.00 |" in out
