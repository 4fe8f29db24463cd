"""What tau a draft keeps when its candidates come only from the N most frequent tokens of a corpus.

A draft level's cost is mostly reading the LM head (its top-k over the whole vocabulary: 30-34 us a
level at SmolLM2's 49k tokens, 1.4 ms a round at Llama-3's 128k on the H200). The candidates need not
be exact for the output to be (the target's check decides), so a head cut to the tokens a corpus
actually uses would be read in a fraction of the time, at the price of the rounds where the target
picks a token outside it. This measures that price: `infer.benchmark` with the draft's candidates
restricted to the N most frequent tokens of the training split (N = 0: the whole vocabulary), by
setting the other tokens' logits to -inf (what a cut head ranks; the special tokens stay):

    python -m benchmarks.draft_vocab_subset --corpus /work/data/smollm2_corpus/train --size 16384 -- \\
        --max-new-tokens 128 --eval-dir infer/eval_sets/smollm2 --tasks code_completion,summarisation \\
        --modes longspec --temperatures 0 --limit 4

The corpus is `train.build_corpus`'s output (`{"text": ...}` jsonl); counted with the target's
tokenizer (`--target` among the benchmark's arguments, default the embedded SmolLM2).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from infer import benchmark
from longspec_jax import draft, proposers


def token_counts(tokenizer, corpus: Path) -> np.ndarray:
    """int64[len(tokenizer)]: how often each token id occurs in the texts of corpus/*.jsonl."""
    counts = np.zeros(len(tokenizer), np.int64)
    texts = [json.loads(line)["text"] for path in sorted(corpus.glob("*.jsonl")) for line in path.open()]
    if not texts:
        raise SystemExit(f"no documents in {corpus}/*.jsonl: build them with python -m train.build_corpus")
    for start in range(0, len(texts), 64):
        for ids in tokenizer(texts[start : start + 64], add_special_tokens=False)["input_ids"]:
            np.add.at(counts, ids, 1)
    return counts


def candidate_bias(counts: np.ndarray, size: int, always: list[int]) -> np.ndarray:
    """float32[V]: 0 for the `size` most frequent ids (ties to the lower id) and `always`, -inf else."""
    bias = np.full(counts.shape, -np.inf, np.float32)
    bias[np.argsort(-counts, kind="stable")[:size]] = 0.0
    bias[always] = 0.0
    return bias


def restricted_candidates(bias):
    """`draft.draft_candidates` with the logits of tokens outside the subset at -inf (XLA path)."""
    bias = jnp.asarray(bias)

    def candidates(target_model, features, k, sampling, noise, *, attn_impl=None):
        logits = target_model.lm_logits(features).astype(jnp.float32)
        return draft.candidates_from_logits(logits + bias[: logits.shape[-1]], k, sampling, noise)

    return candidates


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, required=True, help="a folder of the corpus's training jsonl shards")
    parser.add_argument("--size", type=int, required=True, help="tokens kept as candidates (0: all)")
    parser.add_argument("benchmark_args", nargs=argparse.REMAINDER, help="after --: infer.benchmark's arguments")
    args = parser.parse_args(argv)
    rest = args.benchmark_args[1:] if args.benchmark_args[:1] == ["--"] else args.benchmark_args
    if args.size:
        from longspec_jax.embedded import smollm2_gguf_path
        from longspec_jax.tokenizer import load_tokenizer

        target = rest[rest.index("--target") + 1] if "--target" in rest else smollm2_gguf_path()
        tokenizer = load_tokenizer(target)
        counts = token_counts(tokenizer, args.corpus)
        covered = np.sort(counts)[::-1][: args.size].sum() / counts.sum()
        seen = np.count_nonzero(counts)
        print(f"candidates: the {args.size} most frequent of {seen} tokens seen ({covered:.4%} of the corpus)")
        always = sorted(tokenizer.added_tokens_decoder)  # the special and added tokens
        proposers.draft_candidates = restricted_candidates(candidate_bias(counts, args.size, always))
    return benchmark.main(rest)


if __name__ == "__main__":
    sys.exit(main())
