"""Training configs, `--set` overrides, the CLI's one-line errors, and every config's memory plan."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from longspec_jax.errors import UserError
from train import run, sharding
from train.config import CONFIG_DIR, TrainConfig, apply_overrides, load_config

CONFIG_NAMES = sorted(p.stem for p in CONFIG_DIR.glob("*.py") if not p.stem.startswith("_"))
REPO = Path(__file__).resolve().parent.parent


def test_every_target_of_the_issue_has_a_config():
    assert {"vicuna7b", "llama31_8b", "qwq32b", "smollm2_135m", "tiny"} <= set(CONFIG_NAMES)


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_config_loads_by_name_file_name_and_path(name):
    by_name = load_config(name)
    assert isinstance(by_name, TrainConfig)
    assert load_config(f"{name}.py") == by_name
    assert load_config(str(CONFIG_DIR / f"{name}.py")) == by_name
    for stage in range(1, len(by_name.stages) + 1):
        dataclasses.replace(by_name, stage=stage).validate()


def test_paper_stage_hyperparameters():
    cfg = load_config("vicuna7b")
    s1, s2 = cfg.stages
    assert (s1.seq_len, s1.batch_size, s1.lr, s1.anchor_offset, s1.max_offset) == (1024, 2048, 5e-4, True, 15_000)
    assert (s2.batch_size, s2.lr) == (256, 5e-6)
    assert (cfg.b1, cfg.b2, cfg.eps, cfg.weight_decay, cfg.warmup_fraction, cfg.clip_norm) == (
        0.9,
        0.95,
        1e-6,
        0.1,
        0.1,
        1.0,
    )
    qwq = load_config("qwq32b")
    assert len(qwq.stages) == 3 and qwq.stages[2].seq_len == 32_768 and qwq.stages[0].max_offset == 30_000


def test_overrides_are_typed_by_the_field():
    cfg = apply_overrides(
        load_config("vicuna7b"),
        [
            "seed=7",
            "lr=1e-4",
            "anchor_offset=false",
            "mesh=2,4,1",
            "attn_impl=none",
            "max_steps=1e3",
            "data=a.jsonl,b.parquet",
            "stage=2",
            "output_dir=/tmp/x",
        ],
    )
    assert cfg.seed == 7 and cfg.mesh == (2, 4, 1) and cfg.attn_impl is None and cfg.output_dir == "/tmp/x"
    # stage is applied first, so stage fields land in stage 2
    assert cfg.stage == 2 and cfg.current.lr == 1e-4 and cfg.current.anchor_offset is False
    assert cfg.current.max_steps == 1000 and cfg.current.data == ("a.jsonl", "b.parquet")
    assert cfg.stages[0].lr == 5e-4


@pytest.mark.parametrize(
    "assignment, message",
    [
        ("nonsense=1", "unknown key"),
        ("seed=abc", "not a valid int"),
        ("anchor_offset=maybe", "not a valid bool"),
        ("mesh=1,2", "3 comma-separated"),
        ("lr", "expected key=value"),
        ("log_every=0", "at least 1"),
        ("seq_len=3", "must exceed num_anchors"),
        ("distill=1.5", "must be in \\[0, 1\\]"),
    ],
)
def test_bad_overrides_are_user_errors(assignment, message):
    with pytest.raises(UserError, match=message):
        apply_overrides(load_config("tiny"), [assignment]).validate()


def test_unknown_config_names_the_known_ones():
    with pytest.raises(UserError, match="vicuna7b"):
        load_config("no_such_config")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--config", "no_such_config"], "no config"),
        (["--config", "tiny", "--stage", "3"], "--stage 3 does not exist"),
        (
            [
                "--config",
                "vicuna7b",
                "--target",
                "/no/such/target",
                "--data",
                str(CONFIG_DIR.parent / "corpus" / "tiny.txt"),
            ],
            "target /no/such/target does not exist",
        ),
        (["--config", "tiny", "--data", "/no/such/data.jsonl"], "data path /no/such/data.jsonl does not exist"),
        (["--config", "tiny", "--set", "mesh=3,1,1"], "mesh"),
    ],
)
def test_cli_errors_are_one_line_and_exit_2(argv, message, capsys, tmp_path):
    code = run.main([*argv, "--set", f"output_dir={tmp_path}", "--set", f"data_cache_dir={tmp_path / 'cache'}"])
    err = capsys.readouterr().err
    assert code == 2
    last = err.strip().splitlines()[-1]  # earlier lines may be `datasets` progress bars
    assert last.startswith("error: ") and message in last and "Traceback" not in err
    assert not (tmp_path / "stage1" / "checkpoints").exists()


def test_a_config_with_a_syntax_error_is_one_line(tmp_path, capsys):
    path = tmp_path / "broken.py"
    path.write_text("def config():\n    return TrainConfig(name='x',\n")
    assert run.main(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: config file {path}:2: ") and "syntax" in err and "Traceback" not in err


def test_a_config_that_returns_something_else_is_refused(tmp_path):
    path = tmp_path / "odd.py"
    path.write_text("def config():\n    return {'name': 'x'}\n")
    with pytest.raises(UserError, match="returned dict, not a TrainConfig"):
        load_config(str(path))


@pytest.mark.parametrize("below", ["", "sub"])
def test_an_output_dir_that_is_a_file_is_one_line(tmp_path, capsys, below):
    occupied = tmp_path / "occupied"
    occupied.write_text("not a directory")
    assert run.main(["--config", "tiny", "--set", f"output_dir={occupied / below}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: output_dir=") and f"{occupied} is a file" in err and "Traceback" not in err


def test_cli_error_has_no_traceback_as_a_process(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "-m", "train.run", "--config", "tiny", "--data", str(tmp_path / "missing")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2
    assert "Traceback" not in out.stderr and "does not exist" in out.stderr


# ---- sharding plan and memory, computed from eval_shape (nothing allocated) ----


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_every_stage_fits_the_gpus_the_config_names(name):
    cfg = load_config(name)
    for stage in range(1, len(cfg.stages) + 1):
        plan = sharding.config_memory_plan(dataclasses.replace(cfg, stage=stage))
        assert plan.fits, f"{name} stage {stage}: {plan.describe()}"
        assert plan.target_weights > 0 and plan.draft_state > 0 and plan.activations > 0


def test_plan_rejects_what_cannot_fit():
    # QwQ-32B's bf16 weights alone are ~65 GB: one 80 GB GPU cannot also hold the draft's training state.
    cfg = dataclasses.replace(load_config("qwq32b"), stage=2, num_gpus=1)
    plan = sharding.config_memory_plan(cfg)
    assert not plan.fits and plan.target_weights > 60e9


def test_plan_target_bytes_match_the_parameter_count_and_shard_over_fsdp():
    cfg = load_config("vicuna7b")
    one = sharding.config_memory_plan(dataclasses.replace(cfg, num_gpus=1))
    eight = sharding.config_memory_plan(cfg)
    assert 6.6e9 * 2 < one.target_weights < 6.8e9 * 2  # Vicuna-7B: ~6.74B parameters in bf16
    assert eight.target_weights == pytest.approx(one.target_weights / 8, rel=0.01)
    # The draft is one block: ~236M parameters for a 7B target (docs/ALGORITHM.md 3), 16 B state + 2 B bf16 each.
    assert 0.2e9 * 18 < one.draft_state < 0.27e9 * 18


def test_spec_rule_shards_large_matrices_only():
    assert sharding.spec_for_shape((4096,), 8, 1) == sharding.P()
    assert sharding.spec_for_shape((32000, 4096), 8, 1) == sharding.P("fsdp", None)
    assert sharding.spec_for_shape((4096, 11008), 8, 2) == sharding.P("tensor", "fsdp")
    assert sharding.spec_for_shape((4096, 11008), 1, 1) == sharding.P(None, None)
    assert sharding.resolve_mesh_shape((1, -1, 2), 8) == (1, 4, 2)
    with pytest.raises(UserError):
        sharding.resolve_mesh_shape((3, -1, 1), 8)


def test_multi_host_environment_must_be_complete(monkeypatch):
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    monkeypatch.delenv("JAX_NUM_PROCESSES", raising=False)
    with pytest.raises(UserError, match="JAX_NUM_PROCESSES and JAX_PROCESS_ID"):
        sharding.maybe_initialize_distributed()
