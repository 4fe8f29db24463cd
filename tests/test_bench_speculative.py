"""benchmarks/bench_speculative.py: the table of a run (its floors: tests/test_floors.py)."""


def test_the_round_with_a_lookup_chain_is_timed_on_its_combined_tree(capsys):
    """--lookup-tokens times the tree with the chain beside it: the table says which tree ran."""
    from benchmarks import bench_speculative

    rows = bench_speculative.main(
        [
            "--small",
            "--contexts",
            "64",
            "--rounds",
            "2",
            "--repeats",
            "1",
            "--tree-widths",
            "2,2",
            "--lookup-tokens",
            "3",
        ]
    )
    out = capsys.readouterr().out
    assert "tree (2, 2) with a prompt-lookup chain of 3 tokens" in out
    header = next(line for line in out.splitlines() if line.startswith("shape "))
    row = next(line for line in out.splitlines() if line.startswith("tiny "))
    assert _value(header, row, "round ms") > 0
    # every time beside its floor, and the round's floor against the AR step's
    for name in ("dr fl", "ver fl", "AR fl", "fl r/AR"):
        assert name in header and _value(header, row, name) >= 0, name
    (r,) = rows
    assert r.draft_floor_ms > 0 and r.ar_floor_ms > 0
    assert r.verify_floor_ms >= r.ar_floor_ms  # the same bytes, more rows of matrix work


def _value(header: str, row: str, name: str) -> float:
    """The number under a right-aligned column of the table."""
    end = header.index(name) + len(name)
    return float(row[:end].split()[-1])


def test_each_block_format_is_a_row_and_the_models_int8_route_is_left_as_it_was():
    """--draft-blocks full,int8 times one round each, named in the cands column; --int8-products
    kernel changes the model's route only while the rows are timed."""
    from benchmarks import bench_speculative
    from longspec_jax import model

    args = ["--small", "--contexts", "64", "--rounds", "2", "--repeats", "1", "--tree-widths", "2,2"]
    rows = bench_speculative.main(args + ["--draft-blocks", "full,int8", "--int8-products", "kernel"])

    assert [r.candidates for r in rows] == ["all/block-full", "all/block-int8"]
    assert all(r.round_ms > 0 and not r.error for r in rows)
    assert rows[1].draft_floor_ms < rows[0].draft_floor_ms  # the int8 block's bytes
    assert model.INT8_PRODUCTS == "xla"


def test_no_parts_times_the_round_and_the_ar_step_only():
    """--no-parts: the round and the AR step timed beside their floors, the parts left unmeasured."""
    from benchmarks import bench_speculative

    args = ["--small", "--contexts", "64", "--rounds", "2", "--repeats", "1", "--tree-widths", "2,2", "--no-parts"]
    (row,) = bench_speculative.main(args)

    assert row.round_ms > 0 and row.ar_ms > 0 and not row.error
    assert row.draft_ms != row.draft_ms and row.verify_ms != row.verify_ms and row.parts_sum_ms != row.parts_sum_ms
    assert row.draft_cache_mib > 0 and row.verify_floor_ms > 0
