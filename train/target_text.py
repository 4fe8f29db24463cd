"""Training text in the target's own words: the target continues and answers prompts made from corpus
documents, and the draft later learns from exactly the target's distribution.

    python -m train.target_text --corpus CORPUS/train --out target_text.jsonl [--target PATH]
        [--tasks sample,greedy,summarise,explain,continue] [--batch 64] [--max-new-tokens 256]
        [--prompt-tokens 128,1024 | --prompt-lengths 256,512,1024] [--temperature 0.8] [--passes 1]
        [--max-docs N] [--time-limit-s S] [--seed 0]

One job per document and pass (--passes, default 1): in a fixed hash order of the documents, pass p
gives document i the task --tasks[(i + p) % len(tasks)], so each pass asks a document for another
task; from the second pass on, the prefix or excerpt starts at a line drawn inside the document:
- sample / greedy: a prefix of the document (its length drawn from --prompt-tokens per job), continued
  at --temperature / greedily, raw text (no chat template);
- summarise / explain / continue: an excerpt of the document and an instruction, one user turn of
  the chat template, answered at --temperature (0: greedily, as a greedy eval decodes them).
--prompt-lengths draws each job's prefix or excerpt length from a few fixed values instead of the
--prompt-tokens range, and leaves out a document too short for the length drawn: every prompt then
falls in one of a few padded lengths (two per value: raw text and chat), so the engine compiles a
prefill for a handful of shapes rather than for every bucket of the range (each such compile took
~13 s at batch 256 on the H200).
Each record is one jsonl line: id, task, prompt (the prompt text, chat template included),
response (the generated text), prompt_tokens, response_tokens, and the provenance: source, path,
license, temperature, seed (of its batch: a batch's rows share one call), batch_first_id,
max_new_tokens, target. Token ids are not stored (the trainer tokenises the text; ids would triple
the file). `prompt` + `response` are the trainer's SFT fields (only
the response is trained on). The file is append-only: a run skips the ids already in it, so the same
command resumes where a killed or time-limited run stopped. --time-limit-s stops before a batch that
would not finish in time (judged by the slowest batch so far).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from longspec_jax.errors import UserError
from train.corpus_documents import Document, read_split

CONTINUATIONS = {"sample", "greedy"}
INSTRUCTIONS = {
    "summarise": "Summarise the text above in a few sentences.",
    "explain": "Explain what the text above says or does, step by step, for someone new to it.",
    "continue": "Continue the text above in the same style.",
}
TASKS = ("sample", "greedy", *INSTRUCTIONS)
WINDOW_BATCHES = 16  # jobs are prepared this many batches at a time


class ByteCodec:
    """UTF-8 bytes as ids (mod the vocabulary): the text of a target without a tokenizer (tests)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text: str, chat: bool) -> tuple[str, list[int]]:
        return text, [b % self.vocab_size for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class TokenizerCodec:
    """The target's tokenizer; chat prompts go through its chat template."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def encode(self, text: str, chat: bool) -> tuple[str, list[int]]:
        """(prompt text as the model sees it, ids)."""
        if not chat:
            return text, list(self.tokenizer.encode(text, add_special_tokens=False))
        rendered = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        return rendered, list(self.tokenizer.encode(rendered, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def _order(doc: Document, seed: int) -> bytes:
    return hashlib.sha256(f"{seed}:{doc.key}".encode()).digest()


def make_jobs(
    docs: list[Document],
    tasks,
    codec,
    prompt_tokens: tuple[int, int],
    seed: int,
    passes: int = 1,
    prompt_lengths: tuple[int, ...] = (),
) -> Iterator[dict]:
    """Jobs in a fixed order: pass by pass, one per document, the task taken in turn and shifted by
    one each pass. Each job's prompt length (and, after the first pass, its starting line) is drawn
    from its own generator seeded by its id, so a job is the same whatever runs before it, and the
    first pass is the same whatever --passes says. prompt_lengths: draw the length from these
    values instead of the prompt_tokens range; a document too short for it gives no job."""
    ordered = sorted(docs, key=lambda d: _order(d, seed))
    for p, (i, doc) in itertools.product(range(passes), enumerate(ordered)):
        task = tasks[(i + p) % len(tasks)]
        round_ = p // len(tasks)  # a task comes back to a document every len(tasks) passes
        job_id = f"{task}:{doc.key}" if round_ == 0 else f"{task}.{round_}:{doc.key}"
        rng = random.Random(f"{seed}:{job_id}")
        length = rng.choice(prompt_lengths) if prompt_lengths else rng.randint(*prompt_tokens)
        start = _line_start(doc.text, rng.randrange(max(1, len(doc.text) - 8 * length))) if p else 0
        head = doc.text[start : start + 8 * length]  # enough characters for `length` tokens
        _, ids = codec.encode(head, chat=False)
        if prompt_lengths and len(ids) < length + (16 if task in CONTINUATIONS else 0):
            continue
        if task in CONTINUATIONS:
            if len(ids) < 2 * 16:
                continue
            ids = ids[: min(length, len(ids) - 16)]
            text = codec.decode(ids)
            prompt, prompt_ids = text, ids
        else:
            excerpt = codec.decode(ids[:length])
            prompt, prompt_ids = codec.encode(f"{excerpt.rstrip()}\n\n{INSTRUCTIONS[task]}", chat=True)
        yield {
            "id": job_id,
            "task": task,
            "source": doc.source,
            "path": doc.path,
            "license": doc.license,
            "prompt": prompt,
            "prompt_ids": prompt_ids,
        }


def _line_start(text: str, at: int) -> int:
    """The start of the line holding character `at`."""
    return text.rfind("\n", 0, at) + 1


def done_ids(out: Path) -> set[str]:
    """Ids already in the output (a torn last line from a killed run is ignored and rewritten)."""
    if not out.is_file():
        return set()
    ids = set()
    for line in out.read_text(encoding="utf-8").splitlines():
        try:
            ids.add(json.loads(line)["id"])
        except (json.JSONDecodeError, KeyError):
            continue
    return ids


def _batch_seed(seed: int, first_id: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{first_id}".encode()).digest()[:4], "big")


def generate_target_text(
    generator,
    codec,
    docs: list[Document],
    out: Path,
    *,
    tasks=TASKS,
    batch: int = 64,
    max_new_tokens: int = 256,
    prompt_tokens: tuple[int, int] = (128, 1024),
    temperature: float = 0.8,
    seed: int = 0,
    time_limit_s: float = 0.0,
    max_jobs: int | None = None,
    passes: int = 1,
    prompt_lengths: tuple[int, ...] = (),
    target_name: str = "",
    log=print,
) -> dict:
    """Append the records of the jobs not yet in `out`; returns {"written", "skipped", "stopped"}."""
    unknown = sorted(set(tasks) - set(TASKS))
    if unknown:
        raise UserError(f"unknown task(s) {', '.join(unknown)}: choose from {', '.join(TASKS)}")
    window = generator.target.config.max_position_embeddings
    if prompt_lengths:  # they replace the range
        if min(prompt_lengths) < 1 or max(prompt_lengths) + max_new_tokens + 64 > window:
            raise UserError(
                f"--prompt-lengths {','.join(map(str, prompt_lengths))} must be >= 1 and, with --max-new-tokens "
                f"{max_new_tokens}, fit the {window}-token window"
            )
    elif prompt_tokens[0] < 1 or prompt_tokens[0] > prompt_tokens[1] or prompt_tokens[1] + max_new_tokens + 64 > window:
        raise UserError(
            f"--prompt-tokens {prompt_tokens} + --max-new-tokens {max_new_tokens} must fit the {window}-token window"
        )
    if passes < 1:
        raise UserError(f"--passes {passes} must be at least 1")
    if not temperature >= 0:  # before any batch runs: the greedy ones would otherwise come first
        raise UserError(f"--temperature {temperature} must be >= 0 (0: every task greedy)")
    done = done_ids(out)
    jobs = itertools.islice(
        make_jobs(docs, list(tasks), codec, prompt_tokens, seed, passes, tuple(prompt_lengths)), max_jobs
    )
    start, slowest, written, skipped = time.monotonic(), 0.0, 0, 0
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a", encoding="utf-8") as f:
        # A window of jobs at a time: greedy and sampled jobs in separate batches (one temperature per
        # call), similar prompt lengths together.
        while window_jobs := list(itertools.islice(jobs, batch * WINDOW_BATCHES)):
            todo = [j for j in window_jobs if j["id"] not in done]
            skipped += len(window_jobs) - len(todo)
            temperature_of = {j["id"]: 0.0 if j["task"] == "greedy" else temperature for j in todo}
            for t in sorted(set(temperature_of.values())):
                group = sorted((j for j in todo if temperature_of[j["id"]] == t), key=lambda j: len(j["prompt_ids"]))
                for b in range(0, len(group), batch):
                    if time_limit_s and time.monotonic() - start + slowest > time_limit_s:
                        log(f"time limit: stopping after {written} records")
                        return {"written": written, "skipped": skipped, "stopped": True}
                    chunk = group[b : b + batch]
                    batch_seed = _batch_seed(seed, chunk[0]["id"])
                    t0 = time.monotonic()
                    result = generator.generate(
                        full_batch([j["prompt_ids"] for j in chunk], batch),
                        max_new_tokens=max_new_tokens,
                        temperature=t,
                        seed=batch_seed,
                    )
                    made = result.tokens[: len(chunk)]
                    slowest = max(slowest, time.monotonic() - t0)
                    for job, tokens in zip(chunk, made):
                        record = {
                            **{k: v for k, v in job.items() if k != "prompt_ids"},
                            "prompt_tokens": len(job["prompt_ids"]),
                            "response": codec.decode(tokens),
                            "response_tokens": len(tokens),
                            "temperature": t,
                            "seed": batch_seed,
                            "batch_first_id": chunk[0]["id"],
                            "max_new_tokens": max_new_tokens,
                            "target": target_name,
                        }
                        f.write(json.dumps(record, ensure_ascii=False) + "\n")
                    f.flush()
                    written += len(chunk)
                    new = sum(map(len, made))
                    log(f"{written} records, {new} tokens in {time.monotonic() - t0:.1f} s")
    return {"written": written, "skipped": skipped, "stopped": False}


def full_batch(prompts: list[list[int]], batch: int) -> list[list[int]]:
    """`prompts` padded to `batch` rows with copies of the last (their outputs are dropped): every
    call has one batch size, so the last, short batch of each group compiles nothing new (on the
    H200 each such compile took ~13 s, a third of a 143 s run)."""
    return prompts + [prompts[-1]] * (batch - len(prompts))


def _lengths(text: str | None) -> tuple[int, ...]:
    if not text:
        return ()
    try:
        return tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise UserError(f"--prompt-lengths {text!r}: give token counts, e.g. 256,512,1024") from None


def _range(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise UserError(f"--prompt-tokens {text!r}: give MIN,MAX, e.g. 128,1024") from None
    return lo, hi


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.target_text", description=__doc__.splitlines()[0])
    p.add_argument("--corpus", required=True, type=Path, help="a corpus split folder (OUT/train of build_corpus)")
    p.add_argument("--out", required=True, type=Path, help="jsonl file, appended to (resumes)")
    p.add_argument("--target", help="HF directory or .gguf (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--prompt-tokens", default="128,1024", help="MIN,MAX prompt tokens (document prefix / excerpt)")
    p.add_argument(
        "--prompt-lengths", help="draw prompt tokens from these values instead (e.g. 256,512,1024): few compiled shapes"
    )
    p.add_argument("--temperature", type=float, default=0.8, help="of every task but greedy (0: every task greedy)")
    p.add_argument("--passes", type=int, default=1, help="jobs per document, each pass another task (see above)")
    p.add_argument("--max-docs", type=int, help="use the first N jobs only")
    p.add_argument("--time-limit-s", type=float, default=0.0, help="stop cleanly before this many seconds (0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto")
    args = p.parse_args(argv)
    try:
        import jax

        from longspec_jax.generation import Generator
        from longspec_jax.target import load_target

        if args.batch < 1:
            raise UserError(f"--batch {args.batch} must be at least 1")
        dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if jax.default_backend() == "gpu" else "float32")
        target = load_target(args.target, dtype=dtype)
        codec = (
            TokenizerCodec(target.tokenizer) if target.tokenizer is not None else ByteCodec(target.config.vocab_size)
        )
        tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
        summary = generate_target_text(
            Generator(target, mode="ar"),
            codec,
            read_split(args.corpus),
            args.out,
            tasks=tasks,
            batch=args.batch,
            max_new_tokens=args.max_new_tokens,
            prompt_tokens=_range(args.prompt_tokens),
            temperature=args.temperature,
            seed=args.seed,
            time_limit_s=args.time_limit_s,
            max_jobs=args.max_docs,
            passes=args.passes,
            prompt_lengths=_lengths(args.prompt_lengths),
            target_name=args.target or "embedded SmolLM2-135M-Instruct",
            log=lambda m: print(m, file=sys.stderr, flush=True),
        )
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
