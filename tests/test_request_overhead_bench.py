"""benchmarks/request_overhead.py runs end to end on a tiny model (CPU), with random weights or a
saved checkpoint and an eval set's prompt, and its fit is consistent: the fixed cost and the round
cost reproduce the measured decode time."""

import json
import math

import pytest

from benchmarks import request_overhead
from longspec_jax.adaptive import candidate_plan
from longspec_jax.draft_io import init_draft
from longspec_jax.target import load_target
from tests.tiny_models import save_tiny_checkpoint, tiny_config


def test_small_run_reports_every_mode_and_the_call_costs(capsys):
    report = request_overhead.main(["--small", "--batch-sizes", "1,2", "--repeats", "1"])
    out = capsys.readouterr().out
    seen = [(r["batch"], r["mode"]) for r in report["requests"]]
    assert seen == [(1, "ar"), (1, "auto"), (1, "longspec"), (1, "pld"), (2, "ar"), (2, "auto")]
    for r in report["requests"]:  # times on a busy CPU: the slope's sign is noise here, not a result
        assert math.isfinite(r["round_ms"]) and math.isfinite(r["fixed_ms"]) and r["wall_extra_ms"] >= 0
    auto = next(r for r in report["requests"] if r["mode"] == "auto")
    assert set(auto["calibrated_ms"]) == set(dict(candidate_plan(True, True, 1)))  # greedy, batch 1, a draft
    assert all(v > 0 for v in auto["calibrated_ms"].values())
    assert [(c["rounds"], c["read_only"]) for c in report["calls"]] == [(0, False), (1, False), (1, True)]
    assert all(c["ms"] > 0 for c in report["calls"])
    assert "ms a round" in out and "one call" in out and "flattening the target's" in out
    assert set(report["flatten_ms"]) == {"nnx.State", "plain dicts"} and all(
        v > 0 for v in report["flatten_ms"].values()
    )
    for r in report["requests"]:  # the driver's steps were timed, and untouched afterwards
        steps = r["driver_steps_ms"]
        assert {"run_prefill", "read"} <= set(steps) and all(v > 0 for v in steps.values())
        # mode auto's costs were measured in its warm-up: its set-up rides in the start call
        assert ("policy_setup" in steps) == (r["mode"] == "auto") and "with_remembered" not in steps
    assert request_overhead.generation._Progress.read.__qualname__ == "_Progress.read"
    assert request_overhead.generation.calibrated.__module__ == "longspec_jax.calibration"


def test_the_fit_reproduces_a_linear_cost(monkeypatch):
    """With a simulated generator whose decode time is 3 ms + 0.5 ms a round, 1 ms of it before the
    loop's call, the fit says so."""

    class Stats:
        def __init__(self, rounds):
            self.rounds, self.decode_s, self.prefill_s, self.policy = rounds, 0.003 + 0.0005 * rounds, 0.0, {}
            self.runs = [{"what": "loop", "rounds": rounds, "ms": 2.0 + 0.5 * rounds}]

    class Result:
        def __init__(self, n):
            self.stats = Stats(n - 1)

    class FakeGenerator:
        def __init__(self, *args, **kwargs):
            pass

        def generate(self, prompts, max_new_tokens, eos_token_ids, **request):
            assert request == {"temperature": 1.0, "seed": 4}
            return Result(max_new_tokens)

    monkeypatch.setattr(request_overhead.generation, "Generator", FakeGenerator)

    class Config:
        vocab_size = 100

    class Target:
        config = Config()

    r = request_overhead.per_request(Target(), None, [[1] * 10], "ar", (130, 256), repeats=1, temperature=1.0, seed=4)
    assert abs(r["round_ms"] - 0.5) < 1e-9 and abs(r["fixed_ms"] - 3.0) < 1e-9
    assert abs(r["before_loop_ms"] - 1.0) < 1e-9


def test_a_mode_with_a_lookup_chain_builds_its_generator_with_the_chain(monkeypatch):
    built = []

    class Stopped(Exception):
        pass

    class FakeGenerator:
        def __init__(self, target, draft, **kwargs):
            built.append(kwargs)
            raise Stopped

    monkeypatch.setattr(request_overhead.generation, "Generator", FakeGenerator)
    with pytest.raises(Stopped):
        request_overhead.main(["--small", "--modes", "longspec:4-16-11+pld32", "--batch-sizes", "1"])
    assert built == [{"mode": "longspec", "tree_widths": (4, 16, 11), "lookup_tokens": 32}]


def test_a_saved_model_decodes_an_eval_prompt_in_each_mode(tmp_path, capsys):
    target_dir = save_tiny_checkpoint(tmp_path / "target", tiny_config(), seed=3)
    draft_dir = init_draft(load_target(target_dir), seed=1).save(tmp_path / "draft")
    prompts = tmp_path / "set.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt_ids": list(range(5 + i, 45 + i))}) for i in range(2)) + "\n")
    report = request_overhead.main(
        ["--target", str(target_dir), "--draft", str(draft_dir), "--prompts", str(prompts), "--prompt-index", "1"]
        + ["--temperature", "1", "--modes", "ar,longspec:2-2,auto", "--batch-sizes", "1", "--repeats", "1"]
        + ["--new-tokens", "12,24"]
    )
    out = capsys.readouterr().out
    assert [r["mode"] for r in report["requests"]] == ["ar", "longspec:2-2", "auto"]
    assert report["calls"] == []  # the call probe belongs to random weights
    ar, tree, auto = report["requests"]
    assert ar["rounds"] == [11, 23]  # one token a round
    assert all(0 < t <= a for t, a in zip(tree["rounds"], ar["rounds"]))
    plan = candidate_plan(has_draft=True, greedy=False, batch=1)
    assert set(auto["calibrated_ms"]) == {name for name, _ in plan}
    assert all(ms > 0 for ms in auto["calibrated_ms"].values())
    assert "set[1], 40 tokens; T = 1" in out
