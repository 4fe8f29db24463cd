"""Prompt lookup decoding (PLD): draft candidates copied from earlier text, no draft model.

The last n tokens of a sequence (prompt + generated, the newest being the round's root) are looked
up among the earlier text; the K tokens that followed the most recent earlier occurrence become a
chain of candidates (tree.chain_tree), verified like any tree. The longest match (up to max_ngram
tokens) wins, then the latest, found in one pass vectorised over all start positions: static
shapes, no host loop.

A recent occurrence has fewer than K tokens after it before the sequence ends. Its continuation
then goes on as an overlapping copy does (LZ77's): the copied text repeats with the period between
the occurrence and the sequence's end. Text that repeats itself (a model's loops, tables, code
with repeated lines) then gets a whole chain instead of the few tokens before the end.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def propose_chain(history: jax.Array, lengths: jax.Array, *, num_tokens: int, max_ngram: int = 3, min_ngram: int = 1):
    """history int32[B, L] (valid tokens [0, lengths[b])), lengths int32[B] -> (chain int32[B, K], n_found int32[B]).

    chain[b, :n_found[b]] are the tokens that followed the most recent earlier occurrence of the
    sequence's last n-gram (n from max_ngram down to min_ngram; the first n with a match wins), the
    last p of them repeated where fewer than K follow it (p: the tokens from the occurrence's end
    to the sequence's end); n_found[b] is K after a match, 0 when nothing matched, and then the
    chain is 0s: any token is safe to verify, acceptance keeps only what the target itself would
    produce.
    """
    if not 1 <= min_ngram <= max_ngram:
        raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
    b, seq = history.shape
    lengths = lengths.astype(jnp.int32)
    # One pass over every continuation start e (the token after an earlier occurrence): how many of
    # the tokens before e, up to max_ngram, equal the sequence's last ones. The longest match wins,
    # then the latest e; an occurrence must end before the last token, so e < length.
    ends = jnp.arange(seq, dtype=jnp.int32)
    back = jnp.arange(1, max_ngram + 1, dtype=jnp.int32)  # j-th token back
    last = jnp.take_along_axis(history, jnp.clip(lengths[:, None] - back, 0, seq - 1), axis=1)  # [B, N]
    before = history[:, jnp.clip(ends[:, None] - back, 0, seq - 1)]  # [B, L, N]
    equal = (before == last[:, None, :]) & (ends[:, None] >= back)[None]
    matched = jnp.sum(jnp.cumprod(equal, axis=-1), axis=-1, dtype=jnp.int32)  # [B, L]: the match's n
    usable = (ends[None, :] < lengths[:, None]) & (matched >= min_ngram)
    score = jnp.max(jnp.where(usable, matched * seq + ends[None, :], -1), axis=1)
    best_start = jnp.where(score >= 0, score % seq, -1)  # the continuation's start; -1: no match
    period = jnp.maximum(lengths - best_start, 1)  # >= 1 after a match: an occurrence ends before the last token
    positions = best_start[:, None] + jnp.arange(num_tokens, dtype=jnp.int32)[None, :] % period[:, None]
    found = best_start >= 0
    chain = jnp.where(found[:, None], jnp.take_along_axis(history, jnp.clip(positions, 0, seq - 1), axis=1), 0)
    return chain.astype(jnp.int32), jnp.where(found, num_tokens, 0).astype(jnp.int32)
