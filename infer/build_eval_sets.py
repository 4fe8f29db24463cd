"""Build the long-context evaluation sets from held-out files (never trained on).

    python -m infer.build_eval_sets --out infer/eval_sets/smollm2 [--stdlib-dir D] [--docs-dir D]
    python -m infer.build_eval_sets --out infer/eval_sets/smollm2_diverse --diverse CORPUS

With --diverse the held-out documents are read from CORPUS/eval, the held-out split of
`train.build_corpus --broad --out CORPUS`, and the same three tasks are made across domains
(`build_diverse_sets`); every item then also carries its `domain`, and its id names it.

The held-out documents are those `train.build_corpus` puts in its eval split (same sources, same
rule), so the eval sets never use training files. Prompts are token ids of the SmolLM2 tokenizer
(the GPU machine needs no tokenizer):
- code_completion.jsonl: held-out Python files cut at a line boundary to 2k-7k tokens, raw prompt
  (no chat template); the task is to continue the code (the LCC / RepoBench-P analogue);
- summarisation.jsonl: held-out documentation pages cut at a paragraph boundary, followed by
  SUMMARY_INSTRUCTION, as one user turn of the chat template, 2k-7k tokens (the GovReport analogue);
- prefill_length.jsonl: code prefixes in the buckets of BUCKETS (tau against context length).
Each line: id, task, prompt_ids, prompt_len, text (the prompt text before templating), chat,
source_path, bucket (prefill_length only) and reference (the code that follows, code tasks only).
manifest.json records the tokenizer, its vocabulary size and the length ranges.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from longspec_jax.errors import UserError
from longspec_jax.tokenizer import encode_prompt

CODE_TASK, SUMMARY_TASK, BUCKET_TASK = "code_completion", "summarisation", "prefill_length"
SUMMARY_INSTRUCTION = "Summarise the document above in a few paragraphs."
# The 6-8k bucket stops at 7680 so a prompt plus 512 new tokens (and a speculative tree) stays
# inside SmolLM2's 8192-token window.
BUCKETS = {"1-2k": (1024, 2047), "2-4k": (2048, 4095), "4-6k": (4096, 6143), "6-8k": (6144, 7680)}
REFERENCE_CHARS = 2000  # how much of the true continuation is kept with a code prompt
MIN_CONTINUATION_TOKENS = 64  # a code prompt must leave at least this much file to continue
# Machine-generated code is left out of the prompts: the charmap codecs (made by gencodec.py) are
# tables so repetitive that they would inflate tau, unlike the code a user continues.
GENERATED_CODE = ("python-stdlib/encodings/",)


@dataclasses.dataclass(frozen=True)
class EvalSpec:
    """Length ranges in tokens (inclusive) and how many prompts each set gets."""

    code_range: tuple[int, int] = (2048, 7168)
    summary_range: tuple[int, int] = (2048, 7168)
    buckets: dict = dataclasses.field(default_factory=lambda: dict(BUCKETS))
    per_task: int = 24
    per_bucket: int = 6
    seed: int = 0


def _order_key(key: str, seed: int) -> bytes:
    """A fixed pseudo-random order of documents (so the sets are not all from one folder)."""
    return hashlib.sha256(f"{seed}:{key}".encode()).digest()


def longest_prefix(
    units: Sequence[str], joiner: str, prompt_ids: Callable[[str], list[int]], limit: int
) -> tuple[int, list[int]]:
    """(k, ids): the largest k >= 1 with len(prompt_ids(joiner.join(units[:k]))) <= limit, by
    bisection (the token count grows with k); (0, []) when even one unit is too long."""
    lo, hi, best = 1, len(units), (0, [])
    while lo <= hi:
        mid = (lo + hi) // 2
        ids = prompt_ids(joiner.join(units[:mid]))
        if len(ids) <= limit:
            best, lo = (mid, ids), mid + 1
        else:
            hi = mid - 1
    return best


def code_ids(tokenizer, text: str) -> list[int]:
    # A file may open with blank lines: a blank prefix is just a prompt too short to use.
    return encode_prompt(tokenizer, text, chat=False) if text.strip() else []


def summary_text(body: str) -> str:
    """The user turn of a summarisation prompt."""
    return f"{body.rstrip()}\n\n{SUMMARY_INSTRUCTION}"


def summary_ids(tokenizer, body: str) -> list[int]:
    return encode_prompt(tokenizer, summary_text(body), chat=True)


def code_prompt(tokenizer, doc, target: int, lo: int, hi: int) -> dict | None:
    """The longest prefix of a Python file ending at a line end with at most `target` tokens;
    None unless lo <= its tokens <= hi and some code is left after it."""
    lines = doc.text.splitlines(keepends=True)
    k, ids = longest_prefix(lines, "", lambda text: code_ids(tokenizer, text), target)
    prefix = "".join(lines[:k])
    rest = doc.text[len(prefix) :]
    if not lo <= len(ids) <= hi or not rest.strip():
        return None
    return {"prompt_ids": ids, "text": prefix, "chat": False, "reference": rest[:REFERENCE_CHARS]}


def summary_prompt(tokenizer, doc, target: int, lo: int, hi: int) -> dict | None:
    """Whole paragraphs of a document + SUMMARY_INSTRUCTION as one chat turn, at most `target`
    tokens; None unless lo <= its tokens <= hi."""
    paragraphs = doc.text.split("\n\n")
    k, ids = longest_prefix(paragraphs, "\n\n", lambda body: summary_ids(tokenizer, body), target)
    if not lo <= len(ids) <= hi:
        return None
    return {"prompt_ids": ids, "text": summary_text("\n\n".join(paragraphs[:k])), "chat": True}


def _collect(
    docs,
    make,
    full_len,
    margin: int,
    lo: int,
    hi: int,
    count: int,
    spec: EvalSpec,
    task: str,
    *,
    used: set | None = None,
    first_index: int = 0,
    **extra,
) -> list[dict]:
    """`count` prompts from distinct documents, their target lengths spread evenly over [lo, hi]
    (item i aims at the middle of the i-th of `count` equal slices); each target takes the first
    document, in a fixed pseudo-random order, that is at least target + margin tokens long and
    gives a prompt. `used`: keys already taken (updated); `first_index`: the first item's number."""
    order = sorted(docs, key=lambda d: _order_key(f"{task}:{extra.get('bucket', '')}:{d.key}", spec.seed))
    suffix = "".join(f"-{extra[k].split('/')[-1]}" for k in ("domain", "bucket") if k in extra)
    items, used = [], set() if used is None else used
    for i in range(count):
        target = lo + (hi - lo) * (2 * i + 1) // (2 * count)
        for doc in order:
            if doc.key in used or full_len(doc) < target + margin:
                continue
            item = make(doc, target, lo, hi)
            if item is not None:
                used.add(doc.key)
                items.append(
                    {
                        "id": f"{task}{suffix}-{first_index + i:03d}",
                        "task": task,
                        "prompt_len": len(item["prompt_ids"]),
                        "source_path": doc.key,
                        **extra,
                        **item,
                    }
                )
                break
        else:
            raise UserError(
                f"no unused held-out document gives a {task} prompt of about {target} tokens "
                f"(range {lo}-{hi}, {len(items)} of {count} found): add sources or lower the count"
            )
    return items


def build_eval_sets(code_docs, summary_docs, tokenizer, spec: EvalSpec = EvalSpec()) -> dict[str, list[dict]]:
    """{task: items} from held-out code and documentation `Document`s."""
    code_docs = [d for d in code_docs if not d.key.startswith(GENERATED_CODE)]
    lengths: dict[tuple[str, str], int] = {}

    def full_len(kind: str, ids_of):
        def length(doc) -> int:
            if (kind, doc.key) not in lengths:
                lengths[kind, doc.key] = len(ids_of(tokenizer, doc.text))
            return lengths[kind, doc.key]

        return length

    def code(doc, target, lo, hi):
        return code_prompt(tokenizer, doc, target, lo, hi)

    def summary(doc, target, lo, hi):
        return summary_prompt(tokenizer, doc, target, lo, hi)

    code_len, summary_len = full_len("code", code_ids), full_len("doc", summary_ids)
    sets = {
        CODE_TASK: _collect(
            code_docs, code, code_len, MIN_CONTINUATION_TOKENS, *spec.code_range, spec.per_task, spec, CODE_TASK
        ),
        SUMMARY_TASK: _collect(
            summary_docs, summary, summary_len, 0, *spec.summary_range, spec.per_task, spec, SUMMARY_TASK
        ),
        BUCKET_TASK: [],
    }
    for name, (lo, hi) in spec.buckets.items():
        sets[BUCKET_TASK] += _collect(
            code_docs, code, code_len, MIN_CONTINUATION_TOKENS, lo, hi, spec.per_bucket, spec, BUCKET_TASK, bucket=name
        )
    return sets


@dataclasses.dataclass(frozen=True)
class DiverseSpec:
    """The diverse set: code of several languages and prose of several kinds from the broad corpus.
    A domain with too few long held-out documents gives fewer prompts; one with none is left out
    (named in the manifest)."""

    code_domains: tuple[str, ...] = (
        "code/python",
        "code/c-cpp",
        "code/javascript",
        "code/rust",
        "code/go",
        "code/shell",
    )
    prose_domains: tuple[str, ...] = ("prose/book", "prose/reference", "prose/manual", "prose/readme", "prose/docs")
    length_range: tuple[int, int] = (2048, 7168)
    buckets: dict = dataclasses.field(default_factory=lambda: dict(BUCKETS))
    code_per_domain: int = 4
    prose_per_domain: int = 6
    per_bucket: int = 6
    # The Python-only sets' sources: the diverse set is about everything else.
    exclude_sources: tuple[str, ...] = ("python-stdlib", "python-docs")
    seed: int = 0


def build_diverse_sets(docs, tokenizer, spec: DiverseSpec = DiverseSpec()) -> tuple[dict[str, list[dict]], dict]:
    """({task: items}, {"domains": used, "left_out": {domain: why}}) from held-out broad-corpus
    `Document`s (with domains). code_completion: per code domain, a file cut at a line end;
    summarisation: per prose domain, paragraphs + SUMMARY_INSTRUCTION in the chat template;
    prefill_length: raw continuation prompts per bucket, code and prose domains in turn."""
    lo, hi = spec.length_range
    docs = [d for d in docs if d.source not in spec.exclude_sources and not d.key.startswith(GENERATED_CODE)]
    by_domain: dict[str, list] = {}
    for d in docs:
        by_domain.setdefault(d.domain, []).append(d)
    lengths: dict[tuple[str, str], int] = {}

    def full_len(kind: str, ids_of):
        def length(doc) -> int:
            if (kind, doc.key) not in lengths:
                lengths[kind, doc.key] = len(ids_of(tokenizer, doc.text))
            return lengths[kind, doc.key]

        return length

    code_len, summary_len = full_len("code", code_ids), full_len("doc", summary_ids)

    def code(doc, target, lo, hi):
        return code_prompt(tokenizer, doc, target, lo, hi)

    def summary(doc, target, lo, hi):
        return summary_prompt(tokenizer, doc, target, lo, hi)

    sets: dict[str, list[dict]] = {CODE_TASK: [], SUMMARY_TASK: [], BUCKET_TASK: []}
    used_domains, left_out = [], {}
    plan = [(d, CODE_TASK, code, code_len, MIN_CONTINUATION_TOKENS, spec.code_per_domain) for d in spec.code_domains]
    plan += [(d, SUMMARY_TASK, summary, summary_len, 0, spec.prose_per_domain) for d in spec.prose_domains]
    for domain, task, make, length, margin, count in plan:
        # A domain with few long held-out documents gives fewer prompts (spread over the range anew).
        for n in range(count, 0, -1):
            try:
                sets[task] += _collect(
                    by_domain.get(domain, []), make, length, margin, lo, hi, n, spec, task, domain=domain
                )
                used_domains.append(domain)
                break
            except UserError as e:
                left_out[domain] = str(e)
        if domain in used_domains:
            left_out.pop(domain, None)
    rotation = list(used_domains)
    used_keys: set[str] = set()  # as in the Python-only sets, prefill prompts may reuse the other tasks' files
    for b, (name, (b_lo, b_hi)) in enumerate(spec.buckets.items()):
        for j in range(spec.per_bucket):
            for step in range(len(rotation)):  # the next domain in turn that still has a document
                domain = rotation[(b + j + step) % len(rotation)]
                try:
                    sets[BUCKET_TASK] += _collect(
                        by_domain[domain],
                        code,
                        code_len,
                        MIN_CONTINUATION_TOKENS,
                        b_lo,
                        b_hi,
                        1,
                        spec,
                        BUCKET_TASK,
                        used=used_keys,
                        first_index=j,
                        domain=domain,
                        bucket=name,
                    )
                    break
                except UserError:
                    continue
            else:
                raise UserError(f"no held-out document is left for a {name} prefill prompt: add sources")
    if sum(d.startswith("code/") for d in used_domains) < 3:
        raise UserError(
            f"the held-out split gives code prompts in fewer than 3 languages ({used_domains}): add sources"
        )
    return sets, {"domains": used_domains, "left_out": left_out}


def write_eval_sets(
    out: str | Path, sets: dict[str, list[dict]], tokenizer, spec, tokenizer_name: str, extra: dict | None = None
) -> dict:
    """One jsonl per task plus manifest.json (with `extra`'s fields); returns the manifest."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for task, items in sets.items():
        with (out / f"{task}.jsonl").open("w", encoding="utf-8") as f:
            for item in items:
                f.write(json.dumps(item, ensure_ascii=False) + "\n")
    manifest = {
        "tokenizer": tokenizer_name,
        "vocab_size": len(tokenizer),
        "summary_instruction": SUMMARY_INSTRUCTION,
        "spec": dataclasses.asdict(spec),
        "tasks": {
            task: {
                "prompts": len(items),
                "min_len": min(i["prompt_len"] for i in items),
                "max_len": max(i["prompt_len"] for i in items),
                "tokens": sum(i["prompt_len"] for i in items),
            }
            for task, items in sets.items()
        },
        **(extra or {}),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m infer.build_eval_sets", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path, help="output folder")
    p.add_argument("--stdlib-dir", type=Path, help="as for train.build_corpus (default: this Python's)")
    p.add_argument("--docs-dir", type=Path, help="as for train.build_corpus (default: Debian python3-doc)")
    p.add_argument(
        "--tokenizer", help="HF directory or .gguf whose tokenizer makes the ids (default: embedded SmolLM2)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--diverse",
        type=Path,
        metavar="CORPUS",
        help="build the diverse set from the held-out split (CORPUS/eval) of `train.build_corpus --broad`",
    )
    args = p.parse_args(argv)
    try:
        from longspec_jax.embedded import smollm2_gguf_path
        from longspec_jax.tokenizer import load_tokenizer
        from train.build_corpus import default_sources, held_out_documents

        tokenizer_path = Path(args.tokenizer) if args.tokenizer else smollm2_gguf_path()
        tokenizer = load_tokenizer(tokenizer_path)
        if args.diverse is not None:
            from train.corpus_documents import read_split

            spec = DiverseSpec(seed=args.seed)
            sets, domains = build_diverse_sets(read_split(args.diverse / "eval"), tokenizer, spec)
            corpus = (
                json.loads((args.diverse / "manifest.json").read_text())
                if (args.diverse / "manifest.json").is_file()
                else {}
            )
            extra = {
                **domains,
                "eval_percent": {s["name"]: s["eval_percent"] for s in corpus.get("sources", [])},
                "corpus_eval": corpus.get("eval", {}).get("by_source"),
            }
            manifest = write_eval_sets(args.out, sets, tokenizer, spec, tokenizer_path.name, extra)
            return _report(manifest)
        sources = default_sources(args.stdlib_dir, args.docs_dir)
        spec = EvalSpec(seed=args.seed)
        sets = build_eval_sets(held_out_documents(sources, "code"), held_out_documents(sources, "doc"), tokenizer, spec)
        manifest = write_eval_sets(args.out, sets, tokenizer, spec, tokenizer_path.name)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return _report(manifest)


def _report(manifest: dict) -> int:
    for task, info in manifest["tasks"].items():
        print(f"{task}: {info['prompts']} prompts, {info['min_len']}-{info['max_len']} tokens")
    for domain, why in manifest.get("left_out", {}).items():
        print(f"left out {domain}: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
