"""Mode auto remembers what each candidate kept per round and starts the next request of the same
kind from it (acceptance_memory.py, policy.with_memory)."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from longspec_jax import acceptance_memory, calibration
from longspec_jax.adaptive import Adaptive, Candidate
from longspec_jax.draft import DraftConfig
from longspec_jax.draft_io import init_draft
from longspec_jax.generation import DecodeRequest, Generator, generate
from longspec_jax.policy import FIRST_WAIT, init_policy, with_memory
from longspec_jax.proposers import DraftProposer, NoProposal
from longspec_jax.sampling import SamplingParams
from tests.test_adaptive import VOCAB, fixed_costs, rounds_of
from tests.test_speculative import OracleDraft, sharpened_target

TREE = "tree 4,16,16,16,16"


@pytest.fixture(autouse=True)
def fresh_memory(monkeypatch, tmp_path):
    monkeypatch.setenv("LONGSPEC_CACHE", str(tmp_path))
    calibration.forget_calibrations()
    acceptance_memory.forget_memory()
    yield
    calibration.forget_calibrations()
    acceptance_memory.forget_memory()


@pytest.fixture(scope="module")
def target():
    return sharpened_target(seed=4, vocab_size=VOCAB, eos_token_ids=())


@pytest.fixture(scope="module")
def draft(target):
    return init_draft(target, seed=5, config=DraftConfig(window=8))


def test_with_memory_sets_only_untried_remembered_candidates():
    policy = init_policy(jnp.asarray([1.0, 2.0, 3.0]), max_tokens=[1, 6, 6])
    policy = policy.replace(rounds=jnp.asarray([0, 0, 4], jnp.int32))
    out = with_memory(policy, np.asarray([5.0, 1.5, 4.0]), np.asarray([0, 64, 64]))
    np.testing.assert_allclose(out.tokens_per_round, [1.0, 1.5, policy.tokens_per_round[2]])  # AR stays 1
    assert out.since_used.tolist() == [policy.since_used[0], 0, policy.since_used[2]]  # not due at the start
    assert out.wait.tolist() == [FIRST_WAIT, 64, FIRST_WAIT]
    unknown = with_memory(policy, np.asarray([np.nan, np.nan, np.nan]), np.zeros(3, np.int32))
    assert unknown.tokens_per_round.tolist() == policy.tokens_per_round.tolist()


def test_a_losing_draft_is_not_tried_again_at_the_next_requests_start(target, draft, monkeypatch):
    monkeypatch.setattr(calibration, "measure_rounds", fixed_costs({"ar": 1.0, "pld": 3.0, TREE: 3.0}))
    generator = Generator(target, draft)
    prompt = np.random.default_rng(1).integers(0, VOCAB, 30).tolist()
    ar = generate(target, prompt, mode="ar", max_new_tokens=40, eos_token_ids=())
    first = generator.generate(prompt, max_new_tokens=40, eos_token_ids=())
    second = generator.generate(prompt, max_new_tokens=40, eos_token_ids=())
    assert first.tokens == second.tokens == ar.tokens
    assert first.stats.policy["remembered"] == []
    assert second.stats.policy["remembered"] == ["pld", TREE]
    before, after = rounds_of(first), rounds_of(second)
    assert before[TREE] >= 1 and before["pld"] >= 1  # tried at the start of the first request
    assert after[TREE] < before[TREE] and after["pld"] < before["pld"], (before, after)
    assert after["ar"] > before["ar"]


def test_a_remembered_winner_runs_from_the_first_round(target, monkeypatch):
    widths, name = (3, 4, 4), "tree 3,4,4"
    monkeypatch.setattr(calibration, "measure_rounds", fixed_costs({"ar": 1.0, name: 1.5}))
    rng = np.random.default_rng(4)
    prompt = rng.integers(0, VOCAB, 13).tolist()
    max_new = 40
    reference = generate(target, prompt, mode="ar", max_new_tokens=max_new, eos_token_ids=()).tokens
    known = np.zeros((1, 13 + max_new), np.int32)
    known[0, : 13 + max_new] = prompt + reference[0]
    tree = DraftProposer(OracleDraft(VOCAB), widths)
    adaptive = Adaptive((NoProposal(), tree), (Candidate("ar", 0, NoProposal()), Candidate(name, 1, tree)))
    generator = Generator(target, mode="ar")
    generator.proposer_for_request = lambda request, batch: (adaptive, ((), jnp.asarray(known)))
    request = DecodeRequest(max_new_tokens=max_new, sampling=SamplingParams.create(), seed=0, eos_token_ids=())
    generator.decode([prompt], request)
    second = generator.decode([prompt], request)
    assert second.tokens == reference
    assert second.stats.policy["remembered"] == [name]
    assert rounds_of(second)["ar"] == 0  # no first trial of AR against a tree remembered to win


def test_memory_is_kept_on_disk_and_keyed_by_the_sampling(target, draft, monkeypatch, tmp_path):
    monkeypatch.setattr(calibration, "measure_rounds", fixed_costs({"ar": 1.0, "pld": 3.0, TREE: 3.0}))
    prompt = np.random.default_rng(2).integers(0, VOCAB, 30).tolist()
    generate(target, prompt, draft=draft, max_new_tokens=24, eos_token_ids=())
    files = list((tmp_path / "acceptance").glob("*.json"))
    assert len(files) == 1
    entries = json.loads(files[0].read_text())["candidates"]
    assert set(entries) == {"pld", TREE} and all(e["tokens_per_round"] >= 1.0 for e in entries.values())
    acceptance_memory.forget_memory()  # what a new process starts with
    again = generate(target, prompt, draft=draft, max_new_tokens=24, eos_token_ids=())
    assert again.stats.policy["remembered"] == ["pld", TREE]
    monkeypatch.setattr(calibration, "measure_rounds", fixed_costs({"ar": 1.0, "pld": 3.0, "tree 8,8,8": 3.0}))
    sampled = generate(target, prompt, draft=draft, max_new_tokens=24, temperature=0.7, eos_token_ids=())
    assert sampled.stats.policy["remembered"] == []  # another kind of request


def test_a_damaged_memory_file_is_ignored(target, draft, monkeypatch, tmp_path):
    monkeypatch.setattr(calibration, "measure_rounds", fixed_costs({"ar": 1.0, "pld": 3.0, TREE: 3.0}))
    prompt = np.random.default_rng(2).integers(0, VOCAB, 30).tolist()
    first = generate(target, prompt, draft=draft, max_new_tokens=24, eos_token_ids=())
    (path,) = (tmp_path / "acceptance").glob("*.json")
    path.write_text('{"candidates": {"pld": {"tokens_per_round": "many"}, "tree": 3}}')
    acceptance_memory.forget_memory()
    again = generate(target, prompt, draft=draft, max_new_tokens=24, eos_token_ids=())
    assert again.stats.policy["remembered"] == [] and again.tokens == first.tokens


def test_the_fingerprint_tells_weights_of_one_shape_apart(target):
    a = init_draft(target, seed=5, config=DraftConfig(window=8))
    b = init_draft(target, seed=6, config=DraftConfig(window=8))
    fa, fb = (acceptance_memory.weights_fingerprint(nnx.state(d.block)) for d in (a, b))
    assert fa != fb and fa == acceptance_memory.weights_fingerprint(nnx.state(a.block))
