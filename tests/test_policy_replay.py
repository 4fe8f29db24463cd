"""benchmarks/policy_replay.py: rounds recorded from a fixed mode on a tiny model, and mode auto's
policy replayed on them."""

import json

import numpy as np

from benchmarks import policy_replay


def test_a_round_inside_a_recorded_one_keeps_the_rest_of_it():
    at = policy_replay.keeps_from([3, 1, 2])
    np.testing.assert_array_equal(at, [3, 2, 1, 1, 2, 1, 1])  # the last: past the text, one token


def _eval_dir(folder, vocab_size):
    folder.mkdir()
    (folder / "manifest.json").write_text(json.dumps({"vocab_size": vocab_size}))
    rng = np.random.default_rng(0)
    with (folder / "code_completion.jsonl").open("w") as f:
        for i in range(2):
            motif = rng.integers(3, vocab_size, 7).tolist()  # a repeated motif: the lookup chain copies it
            f.write(json.dumps({"id": f"code-{i}", "task": "code_completion", "prompt_ids": motif * 6}) + "\n")


def test_record_writes_what_each_round_kept_and_replay_times_it(tmp_path, capsys):
    from longspec_jax.draft_io import init_draft
    from longspec_jax.generation import Generator
    from longspec_jax.target import load_target
    from tests.tiny_models import save_tiny_checkpoint, tiny_config

    target_path = save_tiny_checkpoint(tmp_path / "target", tiny_config())
    target = load_target(str(target_path), dtype="float32")
    draft_path = init_draft(target).save(tmp_path / "draft")
    _eval_dir(tmp_path / "eval", target.config.vocab_size)
    out = tmp_path / "keeps.jsonl"
    mode = "longspec:2-2+pld4"
    common = ["--target", str(target_path), "--draft", str(draft_path), "--eval-dir", str(tmp_path / "eval")]
    args = ["record", *common, "--tasks", "code_completion", "--mode", mode, "--max-new-tokens", "12"]
    assert policy_replay.main([*args, "--dtype", "float32", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["code-0", "code-1"]
    generator = Generator(target, init_draft(target), mode="longspec", tree_widths=(2, 2), lookup_tokens=4)
    for row, prompt in zip(
        rows, [json.loads(x)["prompt_ids"] for x in (tmp_path / "eval" / "code_completion.jsonl").open()]
    ):
        assert row["new_tokens"] == 12 and sum(row["keeps"]) == 11  # the first token is the prefill's
        assert all(1 <= k <= policy_replay.most_kept(mode) for k in row["keeps"])
        result = generator.generate(prompt, max_new_tokens=12, eos_token_ids=())
        assert result.stats.rounds == len(row["keeps"])  # one call a round, as the loop runs them
    assert max(k for row in rows for k in row["keeps"]) > 2  # the chain copied the motif

    capsys.readouterr()
    assert policy_replay.main(["replay", str(out), "--ms", "1,2"]) == 0
    table = capsys.readouterr().out.splitlines()
    for row, line in zip(rows, table[2:]):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[0] == row["id"] and float(cells[5].rstrip("x")) == round(11 / (2 * len(row["keeps"])), 2)
    assert table[-1].startswith("| all |")


def test_record_refuses_a_mode_without_its_tree(tmp_path, capsys):
    out = tmp_path / "keeps.jsonl"
    assert policy_replay.main(["record", "--eval-dir", str(tmp_path), "--mode", "auto", "--out", str(out)]) == 2
    assert "longspec:4-16-11+pld32" in capsys.readouterr().err
    assert policy_replay.main(["replay", str(out), "--ms", "1,2"]) == 2
    assert "record" in capsys.readouterr().err  # no file yet: record it first
    out.write_text("")
    assert policy_replay.main(["replay", str(out), "--ms", "1"]) == 2
    assert "two costs" in capsys.readouterr().err
