import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longspec_jax.pld import propose_chain


def reference_chain(seq, num_tokens, max_ngram, min_ngram):
    """Python: the tokens after the most recent earlier occurrence of the longest matching suffix
    n-gram, copied one at a time from the sequence as it grows by the copy (an overlapping copy)."""
    length = len(seq)
    for n in range(max_ngram, min_ngram - 1, -1):
        if length < n + 1:
            continue
        suffix = list(seq[length - n :])
        for start in range(length - n - 1, -1, -1):
            if list(seq[start : start + n]) == suffix:
                grown = list(seq)
                for i in range(num_tokens):
                    grown.append(grown[start + n + i])
                return grown[length:], num_tokens
    return [0] * num_tokens, 0


propose = jax.jit(propose_chain, static_argnames=("num_tokens", "max_ngram", "min_ngram"))


@pytest.mark.parametrize(
    "vocab,num_tokens,max_ngram,min_ngram", [(3, 4, 3, 1), (5, 3, 3, 2), (50, 5, 2, 1), (2, 6, 6, 1), (4, 5, 6, 3)]
)
def test_matches_numpy_reference_on_random_histories(vocab, num_tokens, max_ngram, min_ngram):
    rng = np.random.default_rng(vocab)
    batch, seq = 32, 24
    history = rng.integers(0, vocab, size=(batch, seq))  # tokens past each length are garbage on purpose
    lengths = rng.integers(1, seq + 1, size=batch)
    chain, n_found = propose(history, lengths, num_tokens=num_tokens, max_ngram=max_ngram, min_ngram=min_ngram)
    found = []
    for b in range(batch):
        expected, count = reference_chain(history[b, : lengths[b]], num_tokens, max_ngram, min_ngram)
        np.testing.assert_array_equal(chain[b], expected)
        assert int(n_found[b]) == count
        found.append(count)
    assert 0 in found and num_tokens in found  # both not-found and full proposals occur


def test_longest_ngram_wins_over_a_more_recent_shorter_match():
    #          0  1  2  3  4  5  6  7  8  9
    history = [[7, 8, 9, 1, 2, 5, 9, 3, 8, 9]]
    chain, n_found = propose(np.array(history), np.array([10]), num_tokens=3, max_ngram=2, min_ngram=1)
    # "8 9" occurs at 1..2 (followed by 1 2 5); "9" alone last occurred at 6 (followed by 3).
    np.testing.assert_array_equal(chain, [[1, 2, 5]])
    assert int(n_found[0]) == 3


def test_no_match_and_a_short_continuation_repeated():
    history = np.array([[1, 2, 3, 4, 0, 0], [4, 6, 4, 0, 0, 0]])
    chain, n_found = propose(history, np.array([4, 3]), num_tokens=3, max_ngram=2, min_ngram=1)
    # Row 1: "4" last occurred at 0, followed by "6 4" before the end; the copy goes on with "6".
    np.testing.assert_array_equal(chain, [[0, 0, 0], [6, 4, 6]])
    np.testing.assert_array_equal(n_found, [0, 3])


def test_a_loop_in_the_text_gives_a_whole_chain():
    # The text has fallen into a loop of period 3 ("5 6 7"): the latest occurrence of the last
    # 2-gram "6 7" ends 3 tokens before the end, and the chain repeats the loop for all 8 tokens.
    history = np.array([[1, 2, 5, 6, 7, 5, 6, 7, 5, 6, 7]])
    chain, n_found = propose(history, np.array([11]), num_tokens=8, max_ngram=2, min_ngram=1)
    np.testing.assert_array_equal(chain, [[5, 6, 7, 5, 6, 7, 5, 6]])
    assert int(n_found[0]) == 8


@pytest.mark.parametrize("batch", [1, 3])
def test_write_rows_writes_each_row_at_its_own_start(batch):
    from longspec_jax.proposers import write_rows

    rng = np.random.default_rng(batch)
    buffer = rng.integers(0, 100, (batch, 12)).astype(np.int32)
    values = rng.integers(100, 200, (batch, 4)).astype(np.int32)
    starts = np.array([10, 3, 0][:batch], np.int32)  # 10: past the end, so the write moves back
    want = buffer.copy()
    for b, s in enumerate(starts):
        s = min(s, buffer.shape[1] - values.shape[1])  # lax.dynamic_update_slice keeps a write in bounds
        want[b, s : s + values.shape[1]] = values[b]
    np.testing.assert_array_equal(write_rows(jnp.asarray(buffer), jnp.asarray(values), jnp.asarray(starts)), want)
