"""infer.generate: --json on a tiny local HF checkpoint, and one-line exit-2 errors for bad input."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from infer.generate import main
from longspec_jax.draft_io import init_draft
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


def test_a_drafts_candidate_tokens_the_whole_vocabulary_a_lookup_chain_or_int8_weights_give_the_same_greedy_tokens(
    checkpoint, prompt_file, tmp_path, capsys
):
    target = load_target(checkpoint, dtype="float32")
    vocab = target.config.vocab_size
    draft = init_draft(target, seed=1).with_candidate_tokens(np.arange(0, vocab, 2)).save(tmp_path / "draft")
    args = ["--prompt-file", str(prompt_file), "--target", str(checkpoint), "--max-new-tokens", "6", "--json"]
    args += ["--mode", "longspec", "--draft", str(draft), "--tree-widths", "2,2"]
    runs = []
    extras = (
        [],
        ["--full-draft-vocabulary"],
        ["--lookup-tokens", "3"],
        ["--draft-head", "int8"],
        ["--draft-block", "int8"],
    )
    for extra in extras:
        assert main(args + extra) == 0
        runs.append(json.loads(capsys.readouterr().out)["tokens"])
    ar = Generator(target, mode="ar").generate(prompt_file.read_text(), max_new_tokens=6).tokens[0]
    assert runs == [ar] * len(extras)


def test_plain_output_prints_text_then_stats(checkpoint, prompt_file, capsys):
    assert (
        main(
            [
                "--prompt-file",
                str(prompt_file),
                "--target",
                str(checkpoint),
                "--max-new-tokens",
                "4",
                "--profile",
                "--mode",
                "ar",
            ]
        )
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
        (["--prompt-file", "{tmp}/long.txt", "--mode", "pld", "--sampling-draft", "{tmp}"], "--mode longspec only"),
        (["--prompt-file", "{tmp}/long.txt", "--mode", "ar", "--tree-widths", "4,16"], "longspec or pld only"),
        (["--prompt-file", "{tmp}/long.txt", "--mode", "pld", "--full-draft-vocabulary"], "a draft's modes"),
        (["--prompt-file", "{tmp}/long.txt", "--mode", "ar", "--draft-head", "int8"], "a draft's modes"),
        (["--prompt-file", "{tmp}/long.txt", "--mode", "pld", "--draft-block", "int8"], "--draft-block applies"),
        (["--prompt-file", "{tmp}/long.txt", "--mode", "pld", "--lookup-tokens", "3"], "beside a draft's tree"),
        (["--prompt-file", "{tmp}/long.txt", "--lookup-tokens", "-1"], "--lookup-tokens"),
        (["--prompt-file", "{tmp}/long.txt", "--target", "{ckpt}", "--lookup-tokens", "3"], "no shipped draft"),
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


@pytest.mark.parametrize(
    "args,message",
    [
        (["--top-k", "1e12"], "--top-k: must be an integer from 0 to 2147483647 (0 = off), got '1e12'"),
        (["--top-k", "1000000000000"], "--top-k: must be an integer from 0 to 2147483647"),
        (["--top-k", "-1"], "--top-k: must be an integer from 0 to 2147483647"),
        (["--seed", "1e23"], "--seed: must be an integer from 0 to 4294967295, got '1e23'"),
        (["--seed", str(10**23)], "--seed: must be an integer from 0 to 4294967295"),
        (["--max-new-tokens", "0"], "--max-new-tokens: must be an integer from 1 to 2147483647"),
        (["--mode", "fast"], "invalid choice: 'fast'"),
        ([], "the following arguments are required: --prompt-file"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(args, message, prompt_file, capsys):
    argv = args + ([] if not args else ["--prompt-file", str(prompt_file)])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err


@pytest.fixture
def sigint_handler_restored():
    """main() hands Ctrl-C back to the default action once interrupted; pytest's handler is put back."""
    previous = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_while_loading_exits_130_quietly(prompt_file, monkeypatch, capsys, sigint_handler_restored):
    import infer.generate

    def interrupted_load(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(infer.generate, "load_target", interrupted_load)
    assert main(["--prompt-file", str(prompt_file)]) == 130
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""
    assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL  # a second Ctrl-C ends the process at once


def interrupt_after(monkeypatch, new_tokens: int) -> list:
    """Make Generator.generate stop as the decode driver does on Ctrl-C: a KeyboardInterrupt carrying
    the result of the tokens made so far (here: the first `new_tokens` of the real generation)."""
    made = []
    real = Generator.generate

    def interrupted(self, prompt, **kwargs):
        result = real(self, prompt, **{**kwargs, "max_new_tokens": new_tokens})
        made.append(result)
        interrupt = KeyboardInterrupt()
        interrupt.result = result
        raise interrupt

    monkeypatch.setattr(Generator, "generate", interrupted)
    return made


def test_ctrl_c_during_generation_prints_the_json_made_so_far(
    checkpoint, prompt_file, monkeypatch, capsys, sigint_handler_restored
):
    made = interrupt_after(monkeypatch, 3)
    argv = ["--prompt-file", str(prompt_file), "--target", str(checkpoint), "--max-new-tokens", "20", "--json"]
    assert main(argv) == 130
    captured = capsys.readouterr()
    record = json.loads(captured.out)
    assert record["tokens"] == made[0].tokens[0] and len(record["tokens"]) <= 3
    assert record["text"] == made[0].text[0]
    assert record["stats"]["interrupted"] is True and record["stats"]["new_tokens"] == len(record["tokens"])
    assert captured.err == ""


def test_ctrl_c_during_generation_prints_the_text_made_so_far(
    checkpoint, prompt_file, monkeypatch, capsys, sigint_handler_restored
):
    made = interrupt_after(monkeypatch, 3)
    assert main(["--prompt-file", str(prompt_file), "--target", str(checkpoint), "--max-new-tokens", "20"]) == 130
    captured = capsys.readouterr()
    assert captured.out == made[0].text[0] + "\n"
    assert captured.err.count("\n") == 1 and captured.err.rstrip().endswith("| interrupted")


def test_finished_json_says_not_interrupted(checkpoint, prompt_file, capsys):
    assert (
        main(["--prompt-file", str(prompt_file), "--target", str(checkpoint), "--max-new-tokens", "2", "--json"]) == 0
    )
    assert json.loads(capsys.readouterr().out)["stats"]["interrupted"] is False


# A real SIGINT in a child process: delivered by the signal handler while device work is still in
# flight, then the interpreter exits normally. Neither a traceback nor a C++ abort may show.
SIGINT_SCRIPT = """
import signal, sys, time
# As in a terminal: a shell that starts the suite in the background hands its children SIGINT ignored.
signal.signal(signal.SIGINT, signal.default_int_handler)
import jax.numpy as jnp
import infer.generate
from longspec_jax.generation import Generator

real = Generator.generate
where = sys.argv[1]

def ctrl_c():
    x = jnp.ones((256, 256))
    pending = [x @ x for _ in range(16)]  # dispatched, maybe not finished
    signal.raise_signal(signal.SIGINT)  # to this thread: another thread would take it without waking the sleep
    time.sleep(30)  # the KeyboardInterrupt lands here

def interrupted_generate(self, prompt, **kwargs):
    result = real(self, prompt, **{**kwargs, "max_new_tokens": 2})
    try:
        ctrl_c()
    except KeyboardInterrupt as interrupt:
        interrupt.result = result
        raise

def interrupted_load(*args, **kwargs):
    ctrl_c()

if where == "loading":
    infer.generate.load_target = interrupted_load
else:
    Generator.generate = interrupted_generate
sys.argv = ["infer.generate", *sys.argv[2:]]
sys.exit(infer.generate.main())
"""


@pytest.mark.parametrize("where", ["loading", "generation"])
def test_real_ctrl_c_exits_130_without_traceback_or_abort(where, checkpoint, prompt_file):
    argv = ["--prompt-file", str(prompt_file), "--target", str(checkpoint), "--max-new-tokens", "8", "--json"]
    proc = subprocess.run(
        [sys.executable, "-c", SIGINT_SCRIPT, where, *argv],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
        timeout=300,
    )
    assert proc.returncode == 130, proc.stderr
    assert "Traceback" not in proc.stderr and "terminate" not in proc.stderr and "Fatal" not in proc.stderr
    if where == "generation":
        record = json.loads(proc.stdout)
        assert record["stats"]["interrupted"] is True and 1 <= len(record["tokens"]) <= 2
    else:
        assert proc.stdout == ""
