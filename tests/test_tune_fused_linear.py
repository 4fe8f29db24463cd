"""benchmarks/tune_fused_linear.py on the CPU (interpret mode): it keeps the fastest configuration it
tries and skips one that fails; its XLA row computes what the fused kernel computes."""

import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import tune_fused_linear as tune_module


def test_coordinate_descent_keeps_the_fastest_and_skips_what_fails(monkeypatch):
    monkeypatch.setattr(tune_module, "KNOBS", {"block_cols": (16, 32), "block_k": (32, 48), "num_warps": (3,)})
    times = {None: 5.0, 16: 2.0, 32: 4.0}
    tried = []

    def fake_seconds(inputs, kind, knobs):
        if knobs is None:
            return 3e-6
        tried.append(dict(knobs))
        if knobs["num_warps"] == 3:
            raise ValueError("num_warps must be a power of two")
        return times[knobs["block_cols"]] * 1e-6

    monkeypatch.setattr(tune_module, "call_seconds", fake_seconds)
    logged = []
    xla_us, default_us, best, best_us = tune_module.tune(64, 64, "residual", 1, 1, passes=1, log=logged.append)
    assert best["block_cols"] == 16 and best["num_warps"] is None
    assert (xla_us, default_us, best_us) == (pytest.approx(3.0), pytest.approx(5.0), pytest.approx(2.0))
    assert any("num_warps" in line and "ValueError" in line for line in logged)
    assert all(k["block_k"] != 48 for k in tried)  # a chunk that does not divide K is not tried


@pytest.mark.parametrize("kind", ["norm", "residual", "swiglu"])
def test_the_xla_row_and_the_kernel_compute_the_same(kind):
    x, weights, norm_weight, residual = tune_module.make_inputs(32, 64, kind, 3, 1)
    x, weight = x.astype(jnp.float32), weights[0].astype(jnp.float32)
    norm_weight, residual = norm_weight.astype(jnp.float32), residual.astype(jnp.float32)
    xla = tune_module.xla_projection(x, weight, norm_weight, residual, kind)
    fused = tune_module.pallas_projection(x, weight, norm_weight, residual, kind, dict(tune_module.DEFAULT))
    np.testing.assert_allclose(np.asarray(fused), np.asarray(xla), rtol=1e-5, atol=1e-5)


def test_one_configuration_runs_in_a_device_loop(monkeypatch):
    monkeypatch.setattr(tune_module, "ITERATIONS", 1)
    inputs = tune_module.make_inputs(32, 64, "swiglu", 2, 2)
    seconds = tune_module.call_seconds(inputs, "swiglu", dict(tune_module.DEFAULT))
    assert 0 < seconds < 60
