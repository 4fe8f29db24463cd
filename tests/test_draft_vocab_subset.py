"""benchmarks/draft_vocab_subset.py: token counts of a corpus, the candidate subset, and a draft whose
candidates stay inside it."""

import json

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.decode_kernels import SMALL_CONFIG
from benchmarks.draft_vocab_subset import candidate_bias, restricted_candidates, token_counts
from longspec_jax.sampling import SamplingParams
from longspec_jax.target import random_target


class CharTokenizer:
    """Each character is its code point (below 128): enough of the HF tokenizer interface."""

    def __len__(self):
        return 128

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[ord(c) for c in text] for text in texts]}


def test_counts_and_the_subset_of_the_most_frequent(tmp_path):
    (tmp_path / "train-00000.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in ["abca", "cab", "b"]))
    counts = token_counts(CharTokenizer(), tmp_path)
    assert counts[ord("a")] == 3 and counts[ord("b")] == 3 and counts[ord("c")] == 2 and counts.sum() == 8
    bias = candidate_bias(counts, 2, always=[0])
    # a and b (3 each, the tie to the lower id) and the always-kept id 0; c and the rest excluded.
    assert set(np.flatnonzero(bias == 0)) == {0, ord("a"), ord("b")}
    assert np.all(np.isneginf(np.delete(bias, [0, ord("a"), ord("b")])))


def test_restricted_candidates_come_only_from_the_subset():
    target = random_target(SMALL_CONFIG, seed=0, dtype="float32")
    vocab = SMALL_CONFIG.vocab_size
    kept = np.arange(0, vocab, 3)
    bias = np.full(vocab, -np.inf, np.float32)
    bias[kept] = 0.0
    features = jax.random.normal(jax.random.key(1), (2, 3, SMALL_CONFIG.hidden_size))
    sampling = SamplingParams.create(0.0)
    scores, ids = restricted_candidates(bias)(target.model, features, 4, sampling, jnp.zeros((2, vocab)))
    assert np.all(np.isin(np.asarray(ids), kept)) and np.all(np.isfinite(np.asarray(scores)))
    # The best kept token by the target's own logits ranks first.
    logits = np.asarray(target.model.lm_logits(features))
    assert np.array_equal(np.asarray(ids)[..., 0], kept[np.argmax(logits[..., kept], axis=-1)])
