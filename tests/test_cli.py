"""infer.generate: --json on a tiny local HF checkpoint, and one-line exit-2 errors for bad input."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from infer.generate import main
from longspec_jax.generation import Generator
from longspec_jax.target import load_target
from tests.tiny_models import save_tiny_checkpoint, tiny_config

CONTEXT = 64


def save_word_tokenizer(directory: Path, vocab_size: int) -> None:
    """A whitespace word-level tokenizer over "w0".."wN" (plus <unk>, <s>, </s>), saved HF-style."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(vocab_size - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(
        directory
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_ckpt")
    config = tiny_config(max_position_embeddings=CONTEXT)
    save_tiny_checkpoint(directory, config, seed=3)
    save_word_tokenizer(directory, config.vocab_size)
    return directory


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "prompt.txt"
    path.write_text("w5 w17 w3 w99 w42 w7")
    return path


def test_json_output_matches_the_library(checkpoint, prompt_file, capsys):
    code = main(["--prompt-file", str(prompt_file), "--target", str(checkpoint), "--max-new-tokens", "6", "--json"])
    out = capsys.readouterr().out
    assert code == 0
    record = json.loads(out)
    target = load_target(checkpoint, dtype="float32")
    expected = Generator(target).generate(prompt_file.read_text(), max_new_tokens=6)
    assert record["tokens"] == expected.tokens[0] and 1 <= len(record["tokens"]) <= 6
    assert record["text"] == target.tokenizer.decode(
        record["tokens"], skip_special_tokens=True, clean_up_tokenization_spaces=False
    )
    assert record["stats"]["new_tokens"] == len(record["tokens"])
    assert {"prefill_s", "decode_s", "tokens_per_s", "tau", "rounds", "draft_cache_bytes", "target_cache_bytes"} <= set(
        record["stats"]
    )


def test_plain_output_prints_text_then_stats(checkpoint, prompt_file, capsys):
    assert (
        main(["--prompt-file", str(prompt_file), "--target", str(checkpoint), "--max-new-tokens", "4", "--profile"])
        == 0
    )
    captured = capsys.readouterr()
    assert captured.out.strip().startswith("w") or captured.out.strip() == ""
    assert "tok/s" in captured.err and "step_alone_ms" in captured.err


def bad_prompt_files(tmp_path):
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "long.txt").write_text(" ".join(f"w{i % 100}" for i in range(CONTEXT + 10)))
    return tmp_path


@pytest.mark.parametrize(
    "args,message",
    [
        (["--prompt-file", "{tmp}/missing.txt"], "does not exist"),
        (["--prompt-file", "{tmp}/empty.txt"], "is empty"),
        (["--prompt-file", "{tmp}/latin1.txt"], "not UTF-8"),
        (["--prompt-file", "{tmp}/long.txt", "--target", "{ckpt}"], "context window"),
        (["--prompt-file", "{tmp}/long.txt", "--target", "{tmp}/no_such_model"], "does not exist"),
        (["--prompt-file", "{tmp}/long.txt", "--tree-widths", "4,x"], "--tree-widths"),
        (["--prompt-file", "{tmp}/long.txt", "--mode", "ar", "--draft", "{tmp}"], "--mode longspec only"),
        (["--prompt-file", "{tmp}/long.txt", "--mode", "ar", "--tree-widths", "4,16"], "longspec or pld only"),
        # auto mode on a target without a shipped draft decodes AR, where tree widths mean nothing
        (["--prompt-file", "{tmp}/long.txt", "--target", "{ckpt}", "--tree-widths", "4,16"], "needs a draft"),
    ],
)
def test_user_errors_exit_2_with_one_line(args, message, checkpoint, tmp_path, capsys):
    tmp = bad_prompt_files(tmp_path)
    argv = [a.format(tmp=tmp, ckpt=checkpoint) for a in args]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err


def test_process_exits_2_without_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "infer.generate", "--prompt-file", str(tmp_path / "missing.txt")],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
        timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1 and "does not exist" in proc.stderr


def test_bench_decode_smoke_run(capsys):
    from benchmarks.bench_decode import main as bench_main

    rows = bench_main(["--small", "--contexts", "32", "--steps", "2", "--repeats", "1"])
    assert [(r.impl, r.context, r.error) for r in rows] == [("xla", 32, "")]
    assert rows[0].loop_ms > 0 and rows[0].alone_ms > 0 and rows[0].floor_ms > 0
    assert "tok/s" in capsys.readouterr().out.splitlines()[-2]
