"""The draft's candidate vocabulary: the tokens a draft proposes from, a subset of the target's.

A draft level ranks every token of the vocabulary under the target's LM head, and reading that head
is most of a level's time (30-34 us of ~110 at SmolLM2's 49,152 tokens on the H200; ~1.4 ms a round
at Llama-3's 128k). The candidates need not be exact for the output to be (the target's check
decides every token), so a draft may carry the ids of the tokens its text actually uses
(`Draft.candidate_tokens`, saved with it; `train.candidate_tokens` counts them over a corpus) and
rank only those. The head's rows for them are gathered once, when the proposer is built
(`draft_head.draft_head`), and a level reads that smaller head. Greedy output and the sampling
distribution stay the target's; what a cut costs is the rounds where the target's pick lies
outside it.
"""

from __future__ import annotations

import hashlib

import numpy as np

from longspec_jax.errors import UserError


def check_candidate_tokens(ids, vocab_size: int, source: str) -> np.ndarray:
    """ids as int32[C] if they are distinct token ids of a vocabulary of vocab_size, ascending;
    else a UserError naming the fix."""
    array = np.asarray(ids)
    fix = "rebuild them with python -m train.candidate_tokens, or drop them with its --all"
    if array.ndim != 1 or array.size == 0 or not np.issubdtype(array.dtype, np.integer):
        raise UserError(f"{source}: candidate tokens must be a non-empty list of token ids, got {array.shape}: {fix}")
    if array.min() < 0 or array.max() >= vocab_size:
        raise UserError(
            f"{source}: candidate token ids run from {array.min()} to {array.max()}, outside the target's "
            f"vocabulary of {vocab_size}: they were made for another tokenizer; {fix}"
        )
    if np.any(np.diff(array) <= 0):
        raise UserError(f"{source}: candidate token ids must be distinct and ascending: {fix}")
    return array.astype(np.int32)


def candidate_tokens_key(ids) -> str:
    """A short stable name of a draft's candidate tokens (None: "all"), for the keys of what a
    draft's rounds cost and keep."""
    if ids is None:
        return "all"
    return f"{len(ids)}:{hashlib.sha256(np.asarray(ids, np.int32).tobytes()).hexdigest()[:16]}"
