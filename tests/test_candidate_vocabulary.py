"""A draft's candidate vocabulary (candidate_vocabulary.py): its candidates come from those tokens
only, under either impl, ranked as the whole vocabulary with the others left out would rank them;
it is saved and loaded with the draft and checked; output stays AR's when greedy and the target's
distribution when sampling; `train.candidate_tokens` counts a corpus's labels and writes it."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longspec_jax.candidate_vocabulary import candidate_tokens_key, check_candidate_tokens
from longspec_jax.draft import draft_candidates, draft_logits
from longspec_jax.draft_head import draft_head
from longspec_jax.draft_io import init_draft, load_draft
from longspec_jax.errors import UserError
from longspec_jax.generation import generate
from longspec_jax.proposers import proposer_for
from longspec_jax.sampling import SamplingParams, gumbel_noise
from longspec_jax.target import random_target
from tests.tiny_models import tiny_config

VOCAB = 300
KEPT = np.arange(1, VOCAB, 3).astype(np.int32)  # a third of the vocabulary, not starting at 0


@pytest.fixture(scope="module")
def target():
    return random_target(tiny_config(vocab_size=VOCAB, hidden_size=96), seed=0, dtype="float32")


def restricted(logits, ids):
    """The logits with every token outside ids at -inf: what a cut vocabulary must rank as."""
    out = np.full(logits.shape, -np.inf, np.float32)
    out[..., ids] = logits[..., ids]
    return out


def test_draft_logits_are_the_heads_on_the_candidates_and_minus_inf_elsewhere(target):
    features = jax.random.normal(jax.random.key(1), (2, 3, 96))
    head = draft_head(target.model, KEPT, "target")
    got = np.asarray(draft_logits(target.model, features, head))
    full = np.asarray(draft_logits(target.model, features))
    assert got.shape == full.shape == (2, 3, VOCAB)
    np.testing.assert_allclose(got, restricted(full, KEPT), rtol=1e-5, atol=1e-5)
    assert np.isneginf(np.delete(got, KEPT, axis=-1)).all()


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.6])
def test_candidates_come_from_the_vocabulary_as_the_restricted_logits_rank_them(target, impl, temperature):
    """Under either impl (pallas: the fused head top-k over the gathered rows, interpret mode) the
    candidates are the tokens the whole head's logits rank first once every other token is left
    out, with the noise of the same tokens: ids mapped back to the vocabulary's."""
    features = jax.random.normal(jax.random.key(1), (2, 3, 96)) * 20.0
    sampling = SamplingParams.create(temperature=temperature)
    noise = gumbel_noise(jax.random.key(2), (2, VOCAB), sampling)
    head = draft_head(target.model, KEPT, "target")
    best, ids = draft_candidates(target.model, features, 4, sampling, noise, attn_impl=impl, head=head)
    assert np.isin(np.asarray(ids), KEPT).all()
    # Ranked as by the restricted logits with their log-softmax over the kept tokens.
    logits = restricted(np.asarray(target.model.lm_logits(features)), KEPT)
    kept = logits[..., KEPT]
    if temperature == 0.0:
        scores = jax.nn.log_softmax(kept, axis=-1)
    else:
        scores = kept / temperature + np.asarray(noise)[:, None, KEPT]
    order = np.argsort(-np.asarray(scores), axis=-1, kind="stable")[..., :4]
    np.testing.assert_array_equal(np.asarray(ids), KEPT[order])
    want = np.take_along_axis(np.asarray(scores), order, axis=-1)
    if temperature > 0.0:
        want = want - want[..., :1]  # the margins to the node's best
    np.testing.assert_allclose(np.asarray(best), want, rtol=1e-4, atol=1e-4)


def test_candidate_tokens_are_checked():
    assert check_candidate_tokens([0, 5, 9], 10, "x").dtype == np.int32
    for bad, match in (([], "non-empty"), ([[1, 2]], "non-empty"), ([1, 10], "outside"), ([-1, 3], "outside")):
        with pytest.raises(UserError, match=match):
            check_candidate_tokens(bad, 10, "x")
    for bad in ([3, 3], [4, 2]):
        with pytest.raises(UserError, match="distinct and ascending"):
            check_candidate_tokens(bad, 10, "x")
    assert candidate_tokens_key(None) == "all"
    assert candidate_tokens_key([1, 2]) != candidate_tokens_key([1, 3]) != candidate_tokens_key(None)


def test_saved_and_loaded_with_the_draft_and_checked_on_load(target, tmp_path):
    draft = init_draft(target, seed=1).with_candidate_tokens(KEPT)
    loaded = load_draft(draft.save(tmp_path / "cut"), target)
    np.testing.assert_array_equal(loaded.candidate_tokens, KEPT)
    assert loaded.cast(jnp.bfloat16).candidate_tokens is loaded.candidate_tokens
    assert load_draft(loaded.with_candidate_tokens(None).save(tmp_path / "all"), target).candidate_tokens is None
    small = random_target(tiny_config(vocab_size=200, hidden_size=96), seed=0, dtype="float32")
    with pytest.raises(UserError, match="outside the target's vocabulary of 200"):
        load_draft(tmp_path / "cut", small)
    with pytest.raises(UserError, match="distinct and ascending"):
        draft.with_candidate_tokens(KEPT[::-1])


def test_a_tree_wider_than_the_candidates_is_a_user_error(target):
    draft = init_draft(target, seed=1).with_candidate_tokens([1, 2, 3])
    with pytest.raises(UserError, match="at least that many candidate tokens"):
        proposer_for("longspec", target, draft, (4, 2))
    proposer_for("longspec", target, draft, (3, 3))


def test_greedy_output_with_a_cut_vocabulary_equals_ar():
    """Greedy speculative decoding with candidates from a quarter of the vocabulary (a tree, a drawn
    chain and mode auto) still gives AR's tokens, under both impls."""
    target = random_target(tiny_config(head_dim=64), seed=1, dtype="float32")
    vocab = target.config.vocab_size
    draft = init_draft(target, seed=2).with_candidate_tokens(np.arange(0, vocab, 4))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, vocab, size=9).tolist(), rng.integers(0, vocab, size=5).tolist()]
    reference = generate(target, prompts, mode="ar", max_new_tokens=8, eos_token_ids=(), attn_impl="xla").tokens
    run = functools.partial(generate, target, prompts, draft=draft, max_new_tokens=8, eos_token_ids=())
    for impl, widths in (("xla", (3, 3)), ("xla", (1, 1)), ("pallas", (2, 2))):
        got = run(mode="longspec", tree_widths=widths, attn_impl=impl)
        assert got.tokens == reference, (impl, widths)
    assert run(mode="auto").tokens == reference


def _target_with_words(directory):
    """A tiny HF target directory with a word-level tokenizer of ten words."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tests.tiny_models import save_tiny_checkpoint

    save_tiny_checkpoint(directory, tiny_config())
    words = ["<s>", "</s>", "<unk>", "ab", "cd", "ef", "gh", "zz", "yy", "xx"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(directory)
    return directory


def test_candidate_tokens_tool_counts_training_labels_and_keeps_the_dtype(tmp_path, monkeypatch):
    """train.candidate_tokens: the labels of plain text and of SFT responses (not prompts) are
    counted with the target's tokenizer; the most frequent and the special tokens are kept; the
    draft is written back in its stored dtype; --all drops them again."""
    from longspec_jax.checkpoint_hf import read_safetensors_file
    from longspec_jax.target import load_target
    from train import candidate_tokens

    target_dir = str(_target_with_words(tmp_path / "target"))
    target = load_target(target_dir, dtype="float32")
    draft_dir = init_draft(target, seed=0).cast(jnp.bfloat16).save(tmp_path / "draft")
    data = tmp_path / "data"
    data.mkdir()
    # Labels: ab x4 (text) + ab x1 (response), cd x3, ef x1; zz only in a prompt (no label), x8.
    (data / "train.jsonl").write_text(json.dumps({"text": "ab cd ab cd ab cd ab ef"}))
    (data / "sft.jsonl").write_text(json.dumps({"prompt": "zz zz zz zz zz zz zz zz", "response": "ab"}))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    args = ["--draft", str(draft_dir), "--data", str(data), "--size", "2", "--target", target_dir]
    assert candidate_tokens.main(args) == 0
    cut = load_draft(draft_dir, target)
    # ab, cd and the special tokens <s> </s> <unk> (the eos each record ends with is a label too).
    assert cut.candidate_tokens.tolist() == [0, 1, 2, 3, 4]
    stored = read_safetensors_file(draft_dir / "model.safetensors")
    assert {t.dtype.name for name, t in stored.items() if name != "candidate_tokens"} == {"bfloat16"}
    assert candidate_tokens.main(["--draft", str(draft_dir), "--all", "--target", target_dir]) == 0
    assert load_draft(draft_dir, target).candidate_tokens is None
    assert candidate_tokens.main(["--draft", str(draft_dir), "--target", target_dir]) == 2  # neither flag


def test_most_frequent_ties_to_the_lower_id_and_keeps_the_specials():
    from train.candidate_tokens import most_frequent

    counts = np.array([0, 5, 3, 5, 0, 1])
    np.testing.assert_array_equal(most_frequent(counts, 2, always=[4]), [1, 3, 4])
    np.testing.assert_array_equal(most_frequent(counts, 3), [1, 2, 3])
    with pytest.raises(UserError, match="at least 1"):
        most_frequent(counts, 0)
