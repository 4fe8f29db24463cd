"""The data side of the SmolLM2 draft: corpus builder, eval-set builder, benchmark and plot data.

Built on small fake sources and a character-level stand-in tokenizer; the benchmark smoke runs a
tiny random target (CPU, mode ar) on two prompts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import plot_results
from infer import benchmark, build_eval_sets
from infer.build_eval_sets import SUMMARY_INSTRUCTION, EvalSpec
from longspec_jax.adaptive import DEFAULT_LOOKUP_TOKENS, greedy_deep_tree, tree_candidate_name
from longspec_jax.errors import UserError
from longspec_jax.tree import DEFAULT_WIDTHS
from train.build_corpus import Document, Source, build_corpus, default_sources, split_of

VOCAB = 128  # tiny_config's vocabulary


class CharTokenizer:
    """One token per character (ids 3..127), a marker-based chat template: lengths are easy to reason about."""

    chat_template = "user-turn"

    def __len__(self) -> int:
        return VOCAB

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [3 + ord(c) % (VOCAB - 3) for c in text]

    def apply_chat_template(self, messages, add_generation_prompt: bool, tokenize: bool) -> str:
        assert not tokenize and add_generation_prompt
        return f"<user>{messages[0]['content']}</user><assistant>"


def fake_code(i: int, lines: int) -> str:
    return "\n\n" + "".join(f"def f{i}_{j}(x):\n    return x * {j} + {i}\n" for j in range(lines))


def fake_doc(i: int, paragraphs: int) -> str:
    return "\n\n".join(f"Paragraph {j} of document {i} says something about topic {i * j}." for j in range(paragraphs))


def write_fake_stdlib(root: Path, count: int) -> Path:
    for i in range(count):
        folder = root / ("pkg" if i % 2 else "")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"mod{i:02d}.py").write_text(fake_code(i, 3 + i % 4))
    (root / "site-packages").mkdir()
    (root / "site-packages" / "third_party.py").write_text("x = 1\n")
    (root / "latin1.py").write_bytes("s = 'caf\xe9'\n".encode("latin-1"))
    (root / "copy_of_mod00.py").write_text(fake_code(0, 3))
    return root


def read_jsonl(folder: Path) -> list[dict]:
    return [json.loads(line) for f in sorted(folder.glob("*.jsonl")) for line in f.read_text().splitlines()]


# ----------------------------------------------------------------------------- corpus


def test_corpus_split_is_deterministic_disjoint_and_licensed(tmp_path):
    stdlib = write_fake_stdlib(tmp_path / "lib", 30)
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(6):
        (docs / f"page{i}.rst.txt").write_text(fake_doc(i, 4))
    sources = [
        Source("fake-code", stdlib, "**/*.py", "PSF-2.0", "code", 40, ("site-packages",)),
        Source("fake-docs", docs, "**/*.rst.txt", "PSF-2.0 (docs)", "doc", 40),
    ]

    manifest = build_corpus(tmp_path / "a", sources, shard_mb=0.001)
    build_corpus(tmp_path / "b", sources, shard_mb=0.001)
    a_files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*.jsonl"))
    assert len(a_files) > 2  # several shards
    for rel in a_files:
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes()

    train, held_out = read_jsonl(tmp_path / "a" / "train"), read_jsonl(tmp_path / "a" / "eval")
    assert train and held_out
    for record in train + held_out:
        assert set(record) == {"text", "source", "license", "path"} and record["license"].startswith("PSF-2.0")
    train_keys = {f"{r['source']}/{r['path']}" for r in train}
    eval_keys = {f"{r['source']}/{r['path']}" for r in held_out}
    assert not train_keys & eval_keys
    assert all(split_of(k, 40) == "eval" for k in eval_keys)
    # Every readable file lands in one split, except excluded ones and training copies of held-out texts.
    assert "fake-code/site-packages/third_party.py" not in train_keys | eval_keys
    assert manifest["skipped_not_utf8_or_empty"] == ["fake-code/latin1.py"]
    eval_texts = {r["text"] for r in held_out}
    assert not any(r["text"] in eval_texts for r in train)
    all_files = {f"fake-code/{p.relative_to(stdlib).as_posix()}" for p in stdlib.rglob("*.py")} | {
        f"fake-docs/{p.name}" for p in docs.iterdir()
    }
    missing = all_files - train_keys - eval_keys - {"fake-code/site-packages/third_party.py", "fake-code/latin1.py"}
    assert missing <= {"fake-code/copy_of_mod00.py", "fake-code/mod00.py"}
    assert manifest["train"]["documents"] == len(train) and manifest["eval"]["documents"] == len(held_out)

    capped = build_corpus(tmp_path / "c", sources, max_mb=0.002, shard_mb=0.001)
    assert 0 < capped["train"]["mb"] <= 0.002 < manifest["train"]["mb"]
    assert capped["eval"] == manifest["eval"]


def test_corpus_loads_with_datasets_json(tmp_path):
    import datasets

    stdlib = write_fake_stdlib(tmp_path / "lib", 8)
    build_corpus(tmp_path / "out", default_sources(stdlib, tmp_path / "no_docs"))
    files = sorted(str(p) for p in (tmp_path / "out" / "train").glob("*.jsonl"))
    ds = datasets.load_dataset("json", data_files=files, split="train", cache_dir=str(tmp_path / "cache"))
    assert {"text", "source", "license"} <= set(ds.column_names) and set(ds["source"]) == {"python-stdlib"}


def test_split_rule_spreads_and_respects_percent():
    keys = [f"src/file{i}.py" for i in range(2000)]
    share = sum(split_of(k, 10) == "eval" for k in keys) / len(keys)
    assert 0.07 < share < 0.13
    assert [split_of(k, 10) for k in keys] == [split_of(k, 10) for k in keys]
    assert all(split_of(k, 0) == "train" for k in keys[:50]) and all(split_of(k, 100) == "eval" for k in keys[:50])


# ----------------------------------------------------------------------------- eval sets


def fake_documents(kind: str, count: int, size: int) -> list[Document]:
    make = fake_code if kind == "code" else fake_doc
    return [Document("fake", "PSF-2.0", kind, f"{kind}{i}", make(i, size)) for i in range(count)]


SMALL_SPEC = EvalSpec(
    code_range=(150, 400), summary_range=(150, 400), buckets={"s": (60, 120), "l": (200, 300)}, per_task=3, per_bucket=2
)


def test_eval_sets_respect_bounds_lines_and_chat_template(tmp_path):
    tok = CharTokenizer()
    code_docs, summary_docs = fake_documents("code", 6, 20), fake_documents("doc", 6, 12)
    sets = build_eval_sets.build_eval_sets(code_docs, summary_docs, tok, SMALL_SPEC)
    by_key = {d.key: d.text for d in code_docs + summary_docs}

    assert len(sets["code_completion"]) == 3 and len(sets["summarisation"]) == 3
    for item in sets["code_completion"]:
        assert 150 <= item["prompt_len"] <= 400 and item["prompt_len"] == len(item["prompt_ids"])
        source = by_key[item["source_path"]]
        assert source.startswith(item["text"]) and item["text"].endswith("\n") and len(item["text"]) < len(source)
        assert item["prompt_ids"] == tok.encode(item["text"]) and not item["chat"]
        assert source[len(item["text"]) :].startswith(item["reference"])
    for item in sets["summarisation"]:
        assert 150 <= item["prompt_len"] <= 400 and item["chat"]
        assert item["text"].endswith(SUMMARY_INSTRUCTION)
        body = item["text"][: -len(SUMMARY_INSTRUCTION)].rstrip()
        assert by_key[item["source_path"]].startswith(body)
        assert item["prompt_ids"] == tok.encode(f"<user>{item['text']}</user><assistant>")
    buckets = sets["prefill_length"]
    assert sorted(i["bucket"] for i in buckets) == ["l", "l", "s", "s"]
    for item in buckets:
        lo, hi = SMALL_SPEC.buckets[item["bucket"]]
        assert lo <= item["prompt_len"] <= hi

    manifest = build_eval_sets.write_eval_sets(tmp_path, sets, tok, SMALL_SPEC, "char")
    assert manifest["vocab_size"] == VOCAB and manifest["tasks"]["prefill_length"]["prompts"] == 4
    again = build_eval_sets.build_eval_sets(code_docs, summary_docs, tok, SMALL_SPEC)
    assert again == sets
    assert build_eval_sets.code_ids(tok, "\n\n") == []  # a blank prefix is short, not an error


def test_eval_sets_refuse_too_few_long_documents():
    with pytest.raises(UserError, match="held-out document"):
        build_eval_sets.build_eval_sets(
            fake_documents("code", 6, 2), fake_documents("doc", 6, 12), CharTokenizer(), SMALL_SPEC
        )


# ----------------------------------------------------------------------------- benchmark and plot


def _tiny_eval_sets(folder, prompts_per_task: int) -> None:
    """Eval sets of fake code and docs in `folder`, tokenised by characters, for the benchmark's runs."""
    spec = EvalSpec(
        code_range=(140, 240),
        summary_range=(120, 400),
        buckets={"s": (60, 120)},
        per_task=prompts_per_task,
        per_bucket=1,
    )
    tok = CharTokenizer()
    code = fake_documents("code", 2 * prompts_per_task, 20)
    sets = build_eval_sets.build_eval_sets(code, fake_documents("doc", 4, 12), tok, spec)
    build_eval_sets.write_eval_sets(folder, sets, tok, spec, "char")


def test_prompts_time_their_modes_in_changing_orders():
    modes = ["ar", "auto", "longspec:4-4-4"]
    orders = [benchmark.mode_order(modes, i) for i in range(6)]
    assert orders[0] == modes and orders[1] == ["auto", "longspec:4-4-4", "ar"]
    assert orders[3] == modes[::-1]  # the second cycle runs the other way round
    assert all(sorted(o) == sorted(modes) for o in orders)
    # Over twice as many prompts as modes, every mode runs right after every other one.
    after = {(o[i - 1], o[i]) for o in orders for i in range(1, 3)}
    assert after == {(a, b) for a in modes for b in modes if a != b}
    assert benchmark.mode_order([], 5) == [] and benchmark.mode_order(["ar"], 3) == ["ar"]


def test_benchmark_smoke_on_tiny_target(tmp_path, capsys):
    from tests.tiny_models import save_tiny_checkpoint, tiny_config

    target = save_tiny_checkpoint(tmp_path / "target", tiny_config())
    _tiny_eval_sets(tmp_path / "eval", prompts_per_task=2)
    out = tmp_path / "results.json"

    rc = benchmark.main(
        [
            "--eval-dir",
            str(tmp_path / "eval"),
            "--target",
            str(target),
            "--modes",
            "ar,longspec",
            "--tasks",
            "code_completion",
            "--temperatures",
            "0,1",
            "--max-new-tokens",
            "6",
            "--json-out",
            str(out),
            "--runs-out",
            str(tmp_path / "runs.jsonl"),
        ]
    )
    assert rc == 0
    report = json.loads(out.read_text())
    # The runs file, written as runs finished, rebuilds the same tables without the models.
    assert (
        benchmark.main(["--summarise", str(tmp_path / "runs.jsonl"), "--json-out", str(tmp_path / "again.json")]) == 0
    )
    again = json.loads((tmp_path / "again.json").read_text())
    assert again["runs"] == report["runs"] and again["markdown"] == report["markdown"]
    assert "longspec" in report["skipped_modes"]
    runs = report["runs"]
    assert len(runs) == 4 and {r["mode"] for r in runs} == {"ar"} and {r["temperature"] for r in runs} == {0.0, 1.0}
    for r in runs:
        assert r["tau"] == 1.0 and 1 <= r["new_tokens"] <= 6 and r["decode_s"] > 0 and r["compile_s"] == 0.0
    rows = report["summary"]["by_task"]
    assert {(g["task"], g["mode"]) for g in rows} == {("code_completion", "ar")}
    assert all(g["speedup_vs_ar"] == pytest.approx(1.0) and g["prompts"] == 2 for g in rows)
    assert capsys.readouterr().out.strip().endswith(report["markdown"].splitlines()[-1])

    with pytest.raises(UserError, match="vocabulary"):
        benchmark.run(
            benchmark.build_parser().parse_args(
                [
                    "--eval-dir",
                    str(tmp_path / "eval"),
                    "--target",
                    str(save_tiny_checkpoint(tmp_path / "t2", tiny_config(vocab_size=96))),
                ]
            )
        )

    # --resume after a benchmark died before its last run: only that run is made again.
    runs_file = tmp_path / "runs.jsonl"
    runs_file.write_text("".join(line + "\n" for line in runs_file.read_text().splitlines()[:-1]))
    rc = benchmark.main(
        [
            "--eval-dir",
            str(tmp_path / "eval"),
            "--target",
            str(target),
            "--modes",
            "ar",
            "--tasks",
            "code_completion",
            "--temperatures",
            "0,1",
            "--max-new-tokens",
            "6",
            "--json-out",
            str(out),
            "--runs-out",
            str(runs_file),
            "--resume",
        ]
    )
    resumed = json.loads(out.read_text())["runs"]
    assert rc == 0 and len(runs_file.read_text().splitlines()) == 4
    assert resumed[:3] == report["runs"][:3]  # the kept records, timings and all: not run again
    assert {k: resumed[3][k] for k in ("id", "mode", "temperature", "tokens_sha1")} == {
        k: report["runs"][3][k] for k in ("id", "mode", "temperature", "tokens_sha1")
    }


def fake_run(task, mode, temperature, tau, decode_s, bucket=None, prompt_len=100, matches=None):
    return {
        "id": "x",
        "task": task,
        "bucket": bucket,
        "prompt_len": prompt_len,
        "mode": mode,
        "temperature": temperature,
        "new_tokens": 10,
        "prefill_s": 0.1,
        "decode_s": decode_s,
        "tokens_per_s": 10 / decode_s,
        "tau": tau,
        "rounds": 3,
        "profile": {},
        "matches_ar": matches,
    }


def test_summary_speedup_buckets_and_plot_series():
    runs = [
        fake_run("code_completion", "ar", 0.0, 1.0, 2.0),
        fake_run("code_completion", "pld", 0.0, 2.0, 1.0, matches=True),
        fake_run("prefill_length", "pld", 0.0, 3.0, 1.0, "1-2k", 1500, True),
        fake_run("prefill_length", "pld", 0.0, 2.4, 1.0, "6-8k", 7000, False),
    ]
    summary = benchmark.summarise(runs)
    pld = next(g for g in summary["by_task"] if (g["task"], g["mode"]) == ("code_completion", "pld"))
    assert pld["speedup_vs_ar"] == pytest.approx(2.0) and pld["matches_ar"] == 1.0
    assert summary["tau_change_shortest_to_longest_bucket"]["pld T=0.0"] == pytest.approx(-0.2)

    series = plot_results.plot_series({"summary": summary}, 0.0)
    assert series["speed"]["code_completion"] == {"ar": 5.0, "pld": 10.0}
    assert series["tau"]["pld"] == [("1-2k", 1500, 3.0), ("6-8k", 7000, 2.4)]
    with pytest.raises(UserError, match="temperature"):
        plot_results.plot_series({"summary": summary}, 1.0)


def test_draw_writes_a_png_or_names_the_missing_dependency(tmp_path):
    series = {
        "speed": {"code_completion": {"ar": 5.0, "pld": 10.0}},
        "tau": {"pld": [("1-2k", 1500, 3.0), ("6-8k", 7000, 2.4)]},
    }
    try:
        import matplotlib  # noqa: F401
    except ModuleNotFoundError:
        with pytest.raises(UserError, match="pip install matplotlib"):
            plot_results.draw(series, tmp_path / "plot.png", "title")
        return
    out = plot_results.draw(series, tmp_path / "plot.png", "title")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_from_runs_files_takes_tau_from_the_second(tmp_path, capsys):
    speed_runs = [
        fake_run("code_completion", "ar", 0.0, 1.0, 2.0),
        fake_run("code_completion", "longspec", 0.0, 3.0, 0.5),
        fake_run("prefill_length", "longspec", 0.0, 9.0, 1.0, "1-2k", 1500),
    ]
    tau_runs = [
        fake_run("prefill_length", "longspec", 0.0, 3.5, 9.0, "1-2k", 1500),
        fake_run("prefill_length", "longspec", 0.0, 3.0, 9.0, "6-8k", 7000),
    ]
    for name, runs in (("speed.jsonl", speed_runs), ("tau.jsonl", tau_runs)):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in runs))
    assert plot_results.load_results(tmp_path / "speed.jsonl")["summary"]["by_task"][0]["tokens_per_s"] == 5.0
    drawn = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(plot_results, "draw", lambda series, out, title: drawn.update(series=series, title=title))
        assert (
            plot_results.main(
                [
                    str(tmp_path / "speed.jsonl"),
                    "--tau-from",
                    str(tmp_path / "tau.jsonl"),
                    "--out",
                    str(tmp_path / "p.png"),
                    "--title",
                    "mine",
                ]
            )
            == 0
        )
    assert drawn["title"] == "mine"
    assert drawn["series"]["speed"]["code_completion"] == {"ar": 5.0, "longspec": 20.0}
    assert drawn["series"]["tau"]["longspec"] == [("1-2k", 1500, 3.5), ("6-8k", 7000, 3.0)]
    assert plot_results.main([str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "p.png")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_benchmark_says_when_mode_auto_has_no_draft(tmp_path, capsys):
    """A target without a draft (any checkpoint passed without --draft) runs mode auto with AR and
    prompt lookup alone; the benchmark says so rather than report that as LongSpec's speed."""
    from tests.tiny_models import save_tiny_checkpoint, tiny_config

    target = save_tiny_checkpoint(tmp_path / "target", tiny_config())
    _tiny_eval_sets(tmp_path / "eval", prompts_per_task=1)
    common = ["--eval-dir", str(tmp_path / "eval"), "--target", str(target), "--tasks", "code_completion"]
    assert benchmark.main([*common, "--modes", "auto", "--max-new-tokens", "4"]) == 0
    assert "mode auto runs without a draft" in capsys.readouterr().err
    assert benchmark.main([*common, "--modes", "ar", "--max-new-tokens", "4"]) == 0
    assert "without a draft" not in capsys.readouterr().err


def test_benchmark_longspec_with_tree_widths_matches_ar_and_records_the_tree(tmp_path):
    from longspec_jax.draft_io import init_draft
    from longspec_jax.target import load_target
    from tests.tiny_models import save_tiny_checkpoint, tiny_config

    target = save_tiny_checkpoint(tmp_path / "target", tiny_config())
    draft = init_draft(load_target(str(target), dtype="float32")).save(tmp_path / "draft")
    _tiny_eval_sets(tmp_path / "eval", prompts_per_task=2)
    out = tmp_path / "results.json"
    common = [
        "--eval-dir",
        str(tmp_path / "eval"),
        "--target",
        str(target),
        "--draft",
        str(draft),
        "--modes",
        "ar,longspec",
        "--tasks",
        "code_completion",
        "--temperatures",
        "0",
        "--max-new-tokens",
        "8",
        "--limit",
        "1",
    ]

    assert benchmark.main([*common, "--tree-widths", "2,3", "--json-out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["config"]["tree_widths"] == [2, 3]
    by_mode = {r["mode"]: r for r in report["runs"]}
    assert by_mode["ar"]["tree_widths"] is None
    assert by_mode["longspec"]["tree_widths"] == [2, 3] and by_mode["longspec"]["matches_ar"] is True

    assert benchmark.main([*common, "--modes", "longspec", "--json-out", str(out)]) == 0
    assert json.loads(out.read_text())["runs"][0]["tree_widths"] == [4, 16, 16, 16, 11]  # the engine's default
    assert benchmark.main([*common, "--tree-widths", "4,x"]) == 2

    # Modes with trees of their own run beside the plain ones, each reported under its name.
    modes = ("longspec", "longspec:2", "pld:1-1", "longspec:2+pld3", "auto", "auto+pld0")
    assert benchmark.main([*common, "--modes", ",".join(("ar",) + modes), "--json-out", str(out)]) == 0
    report = json.loads(out.read_text())
    by_mode = {r["mode"]: r for r in report["runs"]}
    assert by_mode["longspec"]["tree_widths"] == [4, 16, 16, 16, 11]
    assert by_mode["longspec:2"]["tree_widths"] == [2] and by_mode["pld:1-1"]["tree_widths"] == [1, 1]
    assert all(by_mode[m]["matches_ar"] is True for m in modes)
    assert {g["mode"] for g in report["summary"]["by_task"]} == {"ar", *modes}
    assert "| longspec:2 |" in report["markdown"]
    # Auto's greedy trees carry the default lookup chain; "+pld0" runs them without.
    assert (
        tree_candidate_name(greedy_deep_tree(DEFAULT_LOOKUP_TOKENS), DEFAULT_LOOKUP_TOKENS)
        in by_mode["auto"]["policy"]["candidates"]
    )
    assert tree_candidate_name(DEFAULT_WIDTHS) in by_mode["auto+pld0"]["policy"]["candidates"]
    for bad in ("longspec:2-x", "ar:2", "tree:2", "pld:0", "ar+pld3", "pld:1+pld2", "longspec+pldx", "auto+pld-1"):
        assert benchmark.main([*common, "--modes", f"ar,{bad}"]) == 2


def test_benchmark_runs_batches_and_the_adaptive_mode(tmp_path, monkeypatch):
    from tests.tiny_models import save_tiny_checkpoint, tiny_config

    monkeypatch.setenv("LONGSPEC_CACHE", str(tmp_path / "cache"))
    target = save_tiny_checkpoint(tmp_path / "target", tiny_config())
    _tiny_eval_sets(tmp_path / "eval", prompts_per_task=3)
    out = tmp_path / "results.json"
    args = ["--eval-dir", str(tmp_path / "eval"), "--target", str(target), "--modes", "ar,auto"]
    args += ["--tasks", "code_completion", "--temperatures", "0", "--max-new-tokens", "6"]
    assert benchmark.main([*args, "--batch-sizes", "1,2", "--json-out", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    batched = [r for r in runs if r["batch"] == 2]
    assert {r["mode"] for r in batched} == {"ar", "auto"} and len(batched) == 2  # 3 prompts: one whole batch
    assert all(r["matches_ar"] for r in runs if r["mode"] == "auto")
    assert all(r["policy"]["candidates"].keys() == {"ar", "pld 10"} for r in runs if r["mode"] == "auto")
    rows = json.loads(out.read_text())["summary"]["by_task"]
    assert {(g["batch"], g["mode"]) for g in rows} == {(1, "ar"), (1, "auto"), (2, "ar"), (2, "auto")}


def test_ignore_eos_makes_every_run_full_length_and_repeats_keep_the_median(tmp_path, monkeypatch):
    from longspec_jax.generation import Generator
    from tests.tiny_models import save_tiny_checkpoint, tiny_config

    target = save_tiny_checkpoint(tmp_path / "target", tiny_config(eos_token_ids=tuple(range(128))))  # all EOS
    _tiny_eval_sets(tmp_path / "eval", prompts_per_task=2)
    out = tmp_path / "results.json"
    args = ["--eval-dir", str(tmp_path / "eval"), "--target", str(target), "--modes", "ar,pld"]
    args += ["--tasks", "code_completion", "--temperatures", "1", "--max-new-tokens", "6", "--batch-sizes", "2"]
    args += ["--json-out", str(out)]
    assert benchmark.main(args) == 0
    assert all(r["new_tokens"] < 12 for r in json.loads(out.read_text())["runs"])  # every token ends a sequence
    calls = []
    real_generate = Generator.generate
    monkeypatch.setattr(
        Generator, "generate", lambda self, *a, **k: calls.append(self.mode) or real_generate(self, *a, **k)
    )
    assert benchmark.main([*args, "--ignore-eos", "--repeats", "3"]) == 0
    assert calls[-6:] == ["ar", "pld"] * 3  # the repeats go round the modes
    report = json.loads(out.read_text())
    assert report["config"]["ignore_eos"] is True
    assert [r["new_tokens"] for r in report["runs"]] == [12, 12]
    for r in report["runs"]:  # each timed three times, the median kept
        assert len(r["decode_s_repeats"]) == 3 and r["decode_s"] == sorted(r["decode_s_repeats"])[1]
    assert benchmark.main([*args, "--repeats", "0"]) == 2
    # --warm-up: the untimed requests per mode and shape (one on this CPU unless asked).
    assert report["config"]["warm_up"] == 1
    calls.clear()
    assert benchmark.main([*args, "--warm-up", "3"]) == 0
    assert calls == ["ar"] * 3 + ["pld"] * 3 + ["ar", "pld"]
    assert json.loads(out.read_text())["config"]["warm_up"] == 3
    assert benchmark.main([*args, "--warm-up", "0"]) == 2


def test_benchmark_warms_each_mode_up_once_per_loop_shape_the_generator_plans(tmp_path, monkeypatch):
    """A new cache size is a new compiled loop: its first request is a warm-up, not a timing. The
    sizes are the generator's (`Generator.cache_rows`), which under memory pressure differ between
    prompts that a power-of-two cache would have grouped."""
    from longspec_jax.generation import Generator
    from tests.tiny_models import save_tiny_checkpoint, tiny_config

    target = save_tiny_checkpoint(tmp_path / "target", tiny_config())
    _tiny_eval_sets(tmp_path / "eval", prompts_per_task=3)
    args = ["--eval-dir", str(tmp_path / "eval"), "--target", str(target), "--modes", "ar,pld"]
    args += ["--tasks", "code_completion", "--temperatures", "0", "--max-new-tokens", "4"]
    args += ["--json-out", str(tmp_path / "results.json")]
    warm_ups = []
    monkeypatch.setattr(benchmark, "_warm_up", lambda generator, *a, **k: warm_ups.append(generator.mode))
    monkeypatch.setattr(Generator, "cache_rows", lambda self, longest, *a, **k: 1024)
    assert benchmark.main(args) == 0
    assert warm_ups == ["ar", "pld"]  # one shape: one warm-up per mode
    warm_ups.clear()
    monkeypatch.setattr(Generator, "cache_rows", lambda self, longest, *a, **k: 1000 + longest)
    assert benchmark.main(args) == 0
    lengths = {r["prompt_len"] for r in json.loads((tmp_path / "results.json").read_text())["runs"]}
    assert len(warm_ups) == 2 * len(lengths) and len(lengths) > 1  # a warm-up per mode and prompt length


def test_warm_up_repeats_until_the_calibration_is_kept(monkeypatch):
    """A warm-up request that ended before timing every candidate leaves the rest to the next, so
    the benchmark warms up again rather than timing a request that still calibrates."""
    from types import SimpleNamespace

    from infer import benchmark

    def generator(sources):
        calls = []

        def generate(prompt_ids, **kwargs):
            calls.append(prompt_ids)
            return SimpleNamespace(stats=SimpleNamespace(policy={"calibration": sources[len(calls) - 1]}))

        return SimpleNamespace(generate=generate), calls

    auto, calls = generator(["measured", "measured", "kept", "kept"])
    benchmark._warm_up(auto, [1, 2], {})
    assert len(calls) == 3
    stuck, calls = generator(["measured"] * 5)
    benchmark._warm_up(stuck, [1, 2], {})
    assert len(calls) == benchmark.WARM_UP_REQUESTS
    fixed_calls = []
    fixed = SimpleNamespace(
        generate=lambda prompt_ids, **kw: fixed_calls.append(1) or SimpleNamespace(stats=SimpleNamespace(policy={}))
    )
    benchmark._warm_up(fixed, [1], {})
    assert len(fixed_calls) == 1  # a fixed mode has no calibration: one request
    # On a GPU more: the runtime builds a loop's command buffers over its first calls.
    benchmark._warm_up(fixed, [1], {}, requests=benchmark.GPU_WARM_UP)
    assert len(fixed_calls) == 1 + benchmark.GPU_WARM_UP
    auto, calls = generator(["measured"] + ["kept"] * 9)
    benchmark._warm_up(auto, [1, 2], {}, requests=4)
    assert len(calls) == 4  # the requests asked for, the calibration kept by then
    auto, calls = generator(["measured"] * 4 + ["kept"] * 5)
    benchmark._warm_up(auto, [1, 2], {}, requests=2)
    assert len(calls) == benchmark.WARM_UP_REQUESTS  # still measuring: up to WARM_UP_REQUESTS


def test_each_repeat_of_a_prompt_starts_from_what_mode_auto_remembered_before_it(tmp_path, monkeypatch):
    import json as json_module

    from longspec_jax import acceptance_memory
    from longspec_jax.generation import Generator
    from tests.tiny_models import save_tiny_checkpoint, tiny_config

    monkeypatch.setenv("LONGSPEC_CACHE", str(tmp_path / "cache"))
    acceptance_memory.forget_memory()
    target = save_tiny_checkpoint(tmp_path / "target", tiny_config())
    _tiny_eval_sets(tmp_path / "eval", prompts_per_task=2)
    seen = []  # (prompt, what was remembered when the request started)
    real_generate = Generator.generate

    def generate(self, prompt_ids, **kwargs):
        seen.append((tuple(prompt_ids), json_module.dumps(acceptance_memory.memory_snapshot(), sort_keys=True)))
        result = real_generate(self, prompt_ids, **kwargs)
        # Every request leaves something new in the memory, as one that ran a candidate does.
        entry = {"tokens_per_round": 2.0, "rounds": len(seen), "wait": 8}
        acceptance_memory.save_memory(f"request {len(seen)}", {"pld 10": entry}, None)
        return result

    monkeypatch.setattr(Generator, "generate", generate)
    args = ["--eval-dir", str(tmp_path / "eval"), "--target", str(target), "--modes", "auto", "--ignore-eos"]
    args += ["--tasks", "code_completion", "--temperatures", "0", "--max-new-tokens", "12", "--repeats", "3"]
    assert benchmark.main([*args, "--json-out", str(tmp_path / "out.json")]) == 0
    prompts = list(dict.fromkeys(p for p, _ in seen))
    assert len(prompts) == 2
    starts = [[memory for p, memory in seen if p == prompt][-3:] for prompt in prompts]  # the timed three
    for memories in starts:
        assert memories[0] == memories[1] == memories[2]
    assert starts[0][0] != starts[1][0]  # the second prompt starts from what the first left
    acceptance_memory.forget_memory()
