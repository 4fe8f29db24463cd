"""Give a draft its candidate tokens: the N most frequent tokens of its training text.

    python -m train.candidate_tokens --draft longspec_jax/drafts/smollm2_135m \\
        --data /work/data/broad_corpus/train --data .stage/target_text --size 16384 [--out DIR]
    python -m train.candidate_tokens --draft DIR --all      # propose from the whole vocabulary again

A draft proposes its tree's candidates from these tokens only, which makes each draft level read
that share of the LM head (longspec_jax/candidate_vocabulary.py); the output stays the target's.
The counts are over the training labels of the --data files, read and tokenised as the trainer
reads them (`train.data.load_corpus`: plain text, or an SFT record's response), with the target's
tokenizer (--target, default the embedded SmolLM2). The special and added tokens are always kept.
The draft is written back in place, or to --out; it prints what share of the counted tokens the
kept ones cover.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from longspec_jax.errors import UserError


def label_counts(corpus, vocab_size: int) -> np.ndarray:
    """int64[vocab_size]: how often each token is a training label in a `train.data.Corpus`."""
    counts = np.zeros(vocab_size, np.int64)
    for record in corpus.records.with_format("numpy"):
        labels = np.asarray(record["tokens"])[np.asarray(record["loss_mask"]) == 1]
        counts += np.bincount(labels, minlength=vocab_size)[:vocab_size]
    return counts


def most_frequent(counts: np.ndarray, size: int, always=()) -> np.ndarray:
    """int32[<= size + len(always)] ascending: the `size` most frequent ids (ties to the lower id)
    and every id of `always`."""
    if size < 1:
        raise UserError(f"--size must be at least 1, got {size}: or pass --all for the whole vocabulary")
    top = np.argsort(-counts, kind="stable")[:size]
    return np.unique(np.concatenate([top, np.asarray(list(always), np.int64)])).astype(np.int32)


def special_ids(tokenizer, vocab_size: int) -> list[int]:
    """The tokenizer's special and added token ids within the vocabulary."""
    ids = set(getattr(tokenizer, "added_tokens_decoder", {})) | set(getattr(tokenizer, "all_special_ids", []))
    return sorted(i for i in ids if 0 <= i < vocab_size)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m train.candidate_tokens", description=__doc__.splitlines()[0])
    p.add_argument("--draft", required=True, help="the draft directory (our export) to give candidate tokens")
    p.add_argument("--data", action="append", default=[], help="training data file or folder (repeatable)")
    p.add_argument("--size", type=int, help="how many of the most frequent tokens to keep")
    p.add_argument("--all", action="store_true", help="drop the candidate tokens: the whole vocabulary")
    p.add_argument("--target", help="the target (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--out", help="write the draft here instead of over --draft")
    return p


def run(args: argparse.Namespace) -> int:
    from longspec_jax.draft_io import load_draft
    from longspec_jax.target import load_target
    from train.data import load_corpus, text_encoder

    if args.all == (args.size is not None):
        raise UserError("pass either --size N (keep the N most frequent tokens) or --all (the whole vocabulary)")
    if args.size is not None and not args.data:
        raise UserError("--size needs the draft's training text to count: pass --data PATH")
    target = load_target(args.target, dtype="float32")
    draft = load_draft(args.draft, target)
    vocab = target.config.vocab_size
    if args.all:
        draft = draft.with_candidate_tokens(None)
        print(f"candidate tokens: the whole vocabulary ({vocab})")
    else:
        if target.tokenizer is None:
            raise UserError("the target has no tokenizer to count with: pass --target with its tokenizer files")
        corpus = load_corpus(args.data, text_encoder(target.tokenizer, target.config), target.config)
        counts = label_counts(corpus, vocab)
        ids = most_frequent(counts, args.size, special_ids(target.tokenizer, vocab))
        covered = counts[ids].sum() / max(counts.sum(), 1)
        seen = np.count_nonzero(counts)
        print(
            f"candidate tokens: {len(ids)} of {vocab} ({seen} seen in {counts.sum():,} training labels); "
            f"they cover {covered:.4%} of those labels"
        )
        draft = draft.with_candidate_tokens(ids)
    print(f"wrote {draft.cast(stored_dtype(args.draft)).save(args.out or args.draft)}")
    return 0


def stored_dtype(path):
    """The dtype of the draft's weights as stored (our export; else float32), so that rewriting it
    keeps its size (load_draft reads every draft as float32, exactly)."""
    from longspec_jax.checkpoint_hf import read_safetensors_file
    from longspec_jax.draft_io import CANDIDATES_TENSOR, WEIGHTS_FILE

    weights = Path(path) / WEIGHTS_FILE
    if not weights.is_file():
        return np.float32
    tensors = read_safetensors_file(weights)
    return next(t.dtype for name, t in tensors.items() if name != CANDIDATES_TENSOR)


def main(argv=None) -> int:
    try:
        return run(build_parser().parse_args(argv))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
