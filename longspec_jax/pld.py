"""Prompt lookup decoding (PLD): draft candidates copied from earlier text, no draft model.

The last n tokens of a sequence (prompt + generated, the newest being the round's root) are looked
up among the earlier text; the K tokens that followed the most recent earlier occurrence become a
chain of candidates (tree.chain_tree), verified like any tree. Longer n-grams are tried first. The
search is vectorised over all start positions: static shapes, no host loop.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def propose_chain(history: jax.Array, lengths: jax.Array, *, num_tokens: int, max_ngram: int = 3, min_ngram: int = 1):
    """history int32[B, L] (valid tokens [0, lengths[b])), lengths int32[B] -> (chain int32[B, K], n_found int32[B]).

    chain[b, :n_found[b]] are the tokens that followed the most recent earlier occurrence of the
    sequence's last n-gram (n from max_ngram down to min_ngram; the first n with a match wins);
    n_found[b] = 0 when nothing matched. Entries past n_found are 0: any token is safe to verify,
    acceptance keeps only what the target itself would produce.
    """
    if not 1 <= min_ngram <= max_ngram:
        raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
    b, seq = history.shape
    lengths = lengths.astype(jnp.int32)
    starts = jnp.arange(seq, dtype=jnp.int32)  # candidate start of an earlier occurrence
    best_start = jnp.full((b,), -1, jnp.int32)  # start of the continuation; -1 = no match yet
    for n in range(max_ngram, min_ngram - 1, -1):
        suffix = jnp.take_along_axis(history, jnp.clip(lengths[:, None] - n + jnp.arange(n), 0, seq - 1), axis=1)
        window = history[:, jnp.clip(starts[:, None] + jnp.arange(n), 0, seq - 1)]  # [B, L, n]
        # An earlier occurrence must end before the last token so that at least one token follows it.
        usable = (starts[None, :] + n < lengths[:, None]) & (lengths[:, None] >= n + 1)
        matches = jnp.all(window == suffix[:, None, :], axis=-1) & usable
        latest = jnp.max(jnp.where(matches, starts[None, :], -1), axis=1)
        best_start = jnp.where((best_start < 0) & (latest >= 0), latest + n, best_start)
    positions = best_start[:, None] + jnp.arange(num_tokens, dtype=jnp.int32)[None, :]
    valid = (best_start[:, None] >= 0) & (positions < lengths[:, None])
    chain = jnp.where(valid, jnp.take_along_axis(history, jnp.clip(positions, 0, seq - 1), axis=1), 0)
    return chain.astype(jnp.int32), valid.sum(axis=1).astype(jnp.int32)
