"""benchmarks/xla_flag_sweep.py: settings parsed, decode_kernels' row read from its JSON, XLA's
refusal of a flag reported as its own line (a real process on the CPU: jax parses XLA_FLAGS for every backend)."""

import argparse

import pytest

from benchmarks.xla_flag_sweep import FIELDS, parse_setting, run_setting


def test_settings_are_name_and_flags():
    assert parse_setting("pdl=--xla_gpu_enable_pdl=true") == ("pdl", "--xla_gpu_enable_pdl=true")
    assert parse_setting("none=") == ("none", "")
    for bad in ("--xla_gpu_enable_pdl=true", "=--x=1", "two words=--x=1"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_setting(bad)


def test_a_setting_xla_takes_gives_decode_kernels_row(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    result = run_setting("--xla_gpu_enable_pdl=true", ["--small", "--new-tokens", "4", "--repeats", "1"], timeout=300)
    assert "error" not in result, result
    assert set(result) == set(FIELDS)
    assert result["ar_kernels"] > 0 and result["round_kernels"] > 0
    assert result["round_vs_ar_step"] == pytest.approx(result["round_ms"] / result["ar_step_ms"])


@pytest.mark.parametrize(
    "flags,message",
    [
        ("--xla_gpu_enable_pdl=maybe", "Couldn't interpret value maybe for flag xla_gpu_enable_pdl"),
        ("--xla_gpu_no_such_flag=1", "Unknown flag in XLA_FLAGS: --xla_gpu_no_such_flag=1"),
    ],
)
def test_a_flag_xla_refuses_is_reported_not_raised(flags, message, monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    result = run_setting(flags, ["--small", "--no-longspec", "--new-tokens", "2", "--repeats", "1"], timeout=120)
    assert message in result["error"]
