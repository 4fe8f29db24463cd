"""benchmarks/decode_kernels.py runs end to end on a tiny model (CPU): every variant, AR and
LongSpec rows, kernel counts from the compiled loops, and the closing table."""

import pytest

from benchmarks import decode_kernels
from longspec_jax import decode_kit


def test_small_run_reports_every_variant_and_fewer_kernels_after(capsys):
    rows = decode_kernels.main(["--small", "--repeats", "1"])
    out = capsys.readouterr().out
    assert [r["variant"] for r in rows] == ["before", "after", "fused_projections", "norms_in_xla"]
    for row in rows:
        assert row["ar_kernels"] > 0 and row["round_kernels"] > row["ar_kernels"]
        assert row["ar_step_ms"] > 0 and row["floor_ms"] > 0 and row["round_ms"] > 0
    before, after, fused, norms_in_xla = rows
    assert after["ar_kernels"] < before["ar_kernels"] and after["round_kernels"] < before["round_kernels"]
    # The CPU's default attention is XLA's, so neither the fused projections nor the norm kernels
    # run: the same programs.
    for same in (fused, norms_in_xla):
        assert (same["ar_kernels"], same["round_kernels"]) == (after["ar_kernels"], after["round_kernels"])
    lines = out.splitlines()
    table = lines[max(i for i, line in enumerate(lines) if line.split()[:1] == ["variant"]) :]
    assert "AR kernels" in table[0]
    assert [line.split()[0] for line in table[1:5]] == ["before", "after", "fused_projections", "norms_in_xla"]
    assert str(after["ar_kernels"]) in table[2].split()


def test_one_variant_with_a_chosen_tree(monkeypatch):
    monkeypatch.setattr(decode_kit, "_COMPILED", {})  # the kernels are counted from programs compiled here
    (row,) = decode_kernels.main(["--small", "--repeats", "1", "--variants", "after", "--tree-widths", "2,2"])
    assert row["variant"] == "after" and row["round_kernels"] > row["ar_kernels"] > 0


def test_longspec_once_per_draft_vocabulary(monkeypatch):
    """--candidate-tokens all,N: a LongSpec row each, the AR step shared; N cuts the draft's
    candidates to the first N ids."""
    monkeypatch.setattr(decode_kit, "_COMPILED", {})
    cuts = []
    original = decode_kernels.with_vocabulary
    monkeypatch.setattr(
        decode_kernels, "with_vocabulary", lambda d, v: cuts.append(original(d, v).candidate_tokens) or original(d, v)
    )
    args = ["--small", "--repeats", "1", "--variants", "after", "--tree-widths", "2,2", "--candidate-tokens", "all,64"]
    rows = decode_kernels.main(args)
    assert [r["variant"] for r in rows] == ["after, all candidates", "after, 64 candidates"]
    assert rows[0]["ar_step_ms"] == rows[1]["ar_step_ms"] and all(r["round_ms"] > 0 for r in rows)
    assert cuts[0] is None and cuts[1].tolist() == list(range(64))
    with pytest.raises(SystemExit, match="neither saved, all nor a positive count"):
        decode_kernels.with_vocabulary(None, "some")


def test_an_unknown_variant_is_refused_before_any_work(capsys):
    with pytest.raises(SystemExit):
        decode_kernels.main(["--small", "--variants", "after,faster"])
    assert "unknown variants ['faster']" in capsys.readouterr().err


LOOP_MODULE = """HloModule m

%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %p = (s32[], f32[4]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[4] get-tuple-element(%p), index=1
  %f = f32[4] fusion(%x), kind=kLoop, calls=%fc, metadata={op_name="jit(decode)/while/body/dot_general"}
  %c = f32[4] custom-call(%f), custom_call_target="k", metadata={op_name="jit(decode)/while/body/jit(log_softmax)/log"}
  %one = s32[] constant(1)
  %n = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[4]) tuple(%n, %c)
}

%cond (p: (s32[], f32[4])) -> pred[] {
  %p = (s32[], f32[4]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %k = s32[] constant(8)
  ROOT %lt = pred[] compare(%i, %k), direction=LT
}

ENTRY %main (a: (s32[], f32[4])) -> (s32[], f32[4]) {
  %a = (s32[], f32[4]) parameter(0)
  ROOT %w = (s32[], f32[4]) while(%a), condition=%cond, body=%body
}
"""


def test_loop_body_kernels_counts_launching_instructions_of_the_loop_body():
    assert decode_kernels.loop_body_kernels(LOOP_MODULE) == 3  # fusion, custom-call, add


def test_kernels_by_op_split_the_count_by_jax_operation():
    by_op = decode_kernels.loop_body_kernels_by_op(LOOP_MODULE)
    assert by_op == {"dot_general": 1, "jit(log_softmax)/log": 1, "?": 1}  # "?": the add has no metadata
