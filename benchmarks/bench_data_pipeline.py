"""How fast the training data pipeline makes batches, apart from any device.

A training step of SmolLM2's draft consumes 64 x 1024 tokens; on one H200 it takes ~0.13 s, so the
pipeline must make well over 500 k tokens/s or the step waits for it. This script tokenises (or
reads from the `datasets` cache) the given data with the target's tokenizer, then times `--batches`
batches of the trainer's own iterator (`train.data.batch_iterator`) after one warm-up batch.

    python -m benchmarks.bench_data_pipeline --data .stage/broad [--target PATH] [--seq-len 1024 --batch 64]
"""

from __future__ import annotations

import argparse
import time


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", action="append", required=True, help="file or folder (repeatable)")
    parser.add_argument(
        "--target", help="HF directory or .gguf (default: the embedded SmolLM2); only its tokenizer is used"
    )
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--batches", type=int, default=40)
    args = parser.parse_args(argv)

    from longspec_jax.target import load_target
    from train.data import batch_iterator, load_corpus, text_encoder

    target = load_target(args.target, dtype="float32")
    corpus = load_corpus(args.data, text_encoder(target.tokenizer, target.config), target.config)
    batches = batch_iterator(corpus, seq_len=args.seq_len, batch_size=args.batch, seed=0)
    next(batches)
    start = time.perf_counter()
    for _ in range(args.batches):
        next(batches)
    seconds = time.perf_counter() - start
    tokens = args.batches * args.batch * args.seq_len
    print(
        f"{corpus.num_tokens} tokens in the corpus; {args.batches} batches of {args.batch} x {args.seq_len}: "
        f"{args.batches / seconds:.1f} batches/s, {tokens / seconds / 1e3:.0f} k tokens/s"
    )


if __name__ == "__main__":
    main()
