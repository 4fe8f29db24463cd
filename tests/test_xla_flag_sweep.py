"""benchmarks/xla_flag_sweep.py: settings parsed, decode_kernels' row read, XLA's refusal of a flag
reported as its own line (a real process on the CPU: jax parses XLA_FLAGS for every backend)."""

import argparse

import pytest

from benchmarks.xla_flag_sweep import ROW, parse_setting, run_setting


def test_settings_are_name_and_flags():
    assert parse_setting("pdl=--xla_gpu_enable_pdl=true") == ("pdl", "--xla_gpu_enable_pdl=true")
    assert parse_setting("none=") == ("none", "")
    for bad in ("--xla_gpu_enable_pdl=true", "=--x=1", "two words=--x=1"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_setting(bad)


def test_the_row_of_decode_kernels_table_is_read():
    table = (
        "variant  AR kernels  AR ms  AR tok/s  floor ms  x floor  round kernels  round ms  round/AR  LongSpec tok/s\n"
        "  after         287  0.722      1397     0.128      5.6            452     1.236      1.71             809\n"
    )
    row = ROW.search(table).groupdict()
    assert (row["ar_kernels"], row["ar_ms"], row["round_kernels"], row["round_ms"]) == ("287", "0.722", "452", "1.236")
    ar_only = "  after         287  0.722      1397     0.128      5.6\n"
    assert ROW.search(ar_only).group("round_ms") is None


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
