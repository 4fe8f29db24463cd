"""Mode "auto": the adaptive engine picks AR, prompt lookup or a draft tree each round (adaptive.py).

Round costs are fixed by the tests (a real measurement on a busy CPU would make the choices, though
never the tokens, vary), so what the policy does follows from the tokens alone. Switching between
candidates is forced where a test needs it, by running a given candidate's loop for one round,
which is what the calibration itself does."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx, struct
from scipy import stats

from longspec_jax import acceptance_memory, calibration
from longspec_jax import generation as generation_module
from longspec_jax.adaptive import (
    COUPLED_TREE,
    DEFAULT_LOOKUP_TOKENS,
    DRAWN_CHAIN,
    SHALLOW_TREE,
    Adaptive,
    Candidate,
    adaptive_proposer,
    candidate_plan,
    greedy_deep_tree,
    tree_candidate_name,
)
from longspec_jax.draft import DraftConfig
from longspec_jax.draft_io import init_draft
from longspec_jax.errors import UserError
from longspec_jax.generation import DecodeRequest, Generator, generate
from longspec_jax.policy import AR, FIRST_WAIT, PolicyState, init_policy, with_costs, with_costs_and_memory, with_memory
from longspec_jax.proposers import DraftProposer, NoProposal, PromptLookup
from longspec_jax.sampling import SamplingParams, SamplingSettings
from longspec_jax.tree import DEFAULT_WIDTHS, lookup_widths, num_nodes
from tests.test_speculative import SAMPLE_VOCAB, SAMPLES, OracleDraft, exact_first_three, sharpened_target

VOCAB = 40
# Greedy batch 1's trees, each with the default lookup chain beside it.
CHAINED_DEEP_TREE = greedy_deep_tree(DEFAULT_LOOKUP_TOKENS)
DEEP = tree_candidate_name(CHAINED_DEEP_TREE, DEFAULT_LOOKUP_TOKENS)
# With no lookup chain (lookup_tokens=0): the longspec mode's tree, a shallow one, the chain alone.
UNCHAINED = ("pld 10", tree_candidate_name(DEFAULT_WIDTHS), tree_candidate_name(SHALLOW_TREE))


@pytest.fixture(autouse=True)
def fresh_calibrations(monkeypatch, tmp_path):
    """Each test measures (or fixes) its own costs: nothing kept from another test."""
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


def fixed_costs(seconds_by_name):
    """A measure_rounds stand-in: no calibration rounds, the given costs."""

    def measure(state, run, candidates):
        names = list(seconds_by_name)
        assert len(names) == candidates
        return state, np.asarray([seconds_by_name[n] for n in names])

    return measure


def forced_sequence(order):
    """A measure_rounds stand-in that runs one round of each candidate index in `order` (switching
    every round), then hands over to the policy with equal costs."""

    def measure(state, run, candidates):
        assert max(order) < candidates, "a forced round of a candidate the plan does not hold"
        for k in order:
            state = run(state, int(state.rounds) + 1, k)
        return state, np.ones(candidates)

    return measure


def rounds_of(result):
    return {name: c["rounds"] for name, c in result.stats.policy["candidates"].items()}


def test_plans_fit_sampling_and_batch():
    assert [n for n, _ in candidate_plan(False, True, 1)] == ["ar", "pld 10"]
    greedy = dict(candidate_plan(True, True, 1))
    sampled = dict(candidate_plan(True, False, 1))
    batched = dict(candidate_plan(True, True, 8))
    batched_sampled = dict(candidate_plan(True, False, 4))
    tree = lambda plan: next(w for n, w in plan.items() if n.startswith("tree"))
    assert len(tree(greedy)) > len(tree(sampled))  # greedy affords depth
    assert sum(tree(batched)) < sum(tree(greedy))  # large batches get smaller trees
    # ... down to the smallest: a one-token chain and a two-node tree.
    assert batched == {"ar": (), "pld 1": (1,), "tree 2": (2,)}
    # At T > 0 the draft's candidate is a small tree coupled with the target's picks, at large
    # batches a token drawn from it.
    trees = lambda plan: sorted(w for n, w in plan.items() if n.startswith("tree"))  # noqa: E731
    # Greedy at batch 1: the deep tree with a lookup chain beside it, and no chain alone (the tree's
    # round keeps at least what the chain would).
    assert trees(greedy) == [CHAINED_DEEP_TREE] and not any(name.startswith("pld") for name in greedy)
    assert trees(sampled) == [COUPLED_TREE]
    assert trees(batched_sampled) == [DRAWN_CHAIN]
    assert sum(COUPLED_TREE) < sum(tree(greedy))
    assert batched_sampled["pld 1"] == (1,)
    # Beside the coupled tree no prompt lookup below batch 4 (at T = 1 it kept AR's rate); without a
    # draft a short chain, where a round keeps little.
    assert not any(name.startswith("pld") for name in sampled)
    assert len(dict(candidate_plan(False, False, 1))["pld 2"]) < len(dict(candidate_plan(False, True, 1))["pld 10"])


def test_random_draft_falls_back_to_ar_and_stays_exact(target, draft, monkeypatch, tmp_path):
    monkeypatch.setattr(calibration, "measure_rounds", fixed_costs({"ar": 1.0, DEEP: 2.0}))
    prompt = np.random.default_rng(1).integers(0, VOCAB, 30).tolist()
    ar = generate(target, prompt, mode="ar", max_new_tokens=48, eos_token_ids=())
    auto = generate(target, prompt, draft=draft, max_new_tokens=48, eos_token_ids=())
    assert auto.tokens == ar.tokens
    rounds = rounds_of(auto)
    assert rounds["ar"] >= 0.7 * sum(rounds.values()), rounds
    assert auto.stats.policy["candidates"][DEEP]["tokens_per_round"] < 2.0


def test_a_draft_that_is_always_right_keeps_speculating(target, monkeypatch):
    # The oracle draft of test_speculative knows the greedy continuation (right ~85 % of the time).
    widths = (3, 4, 4)
    name = "tree 3,4,4"
    monkeypatch.setattr(calibration, "measure_rounds", fixed_costs({"ar": 1.0, name: 1.5}))
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, VOCAB, 13).tolist(), rng.integers(0, VOCAB, 6).tolist()]
    max_new = 40
    reference = generate(target, prompts, mode="ar", max_new_tokens=max_new, eos_token_ids=()).tokens
    known = np.zeros((2, 13 + max_new), np.int32)
    for b, (p, out) in enumerate(zip(prompts, reference)):
        known[b, : len(p) + len(out)] = p + out
    tree = DraftProposer(OracleDraft(VOCAB), widths)
    adaptive = Adaptive((NoProposal(), tree), (Candidate("ar", (0,), NoProposal()), Candidate(name, (1,), tree)))
    generator = Generator(target, mode="ar")
    generator.proposer_for_request = lambda request, batch: (adaptive, ((), jnp.asarray(known)))
    request = DecodeRequest(max_new_tokens=max_new, sampling=SamplingSettings(), seed=0, eos_token_ids=())
    result = generator.decode(prompts, request)
    assert result.tokens == reference
    rounds = rounds_of(result)
    assert rounds[name] >= 0.9 * sum(rounds.values()), rounds
    assert result.stats.policy["candidates"][name]["tokens_per_round"] > 2.5
    assert result.stats.policy["candidate_runs"] <= 3 < sum(rounds.values())  # the tree's rounds run back to back


def test_when_sampling_the_estimate_averages_over_more_rounds(target, draft, monkeypatch):
    # A cheap coupled tree runs every round. When sampling, its estimate stays the running mean of
    # its prior (its break-even, 0.5 tokens) and its rounds up to 64 rounds; greedy decoding's
    # weight would make it an average of the last ~8 rounds from the 8th round on.
    monkeypatch.setattr(calibration, "measure_rounds", fixed_costs({"ar": 1.0, COUPLED: 0.5}))
    prompt = np.random.default_rng(6).integers(0, VOCAB, 20).tolist()
    result = generate(target, prompt, draft=draft, max_new_tokens=40, temperature=1.0, seed=3, eos_token_ids=())
    tree = result.stats.policy["candidates"][COUPLED]
    rounds, mean = tree["rounds"], tree["tokens_per_round"]
    assert rounds == sum(rounds_of(result).values()) >= 8
    assert mean != round(mean)  # rounds kept different numbers of tokens: the two averages differ
    assert tree["estimate"] == pytest.approx((0.5 + rounds * mean) / (1 + rounds), rel=1e-5)


def test_switching_every_round_keeps_greedy_output_and_the_cache(target, draft, monkeypatch, tmp_path):
    monkeypatch.setattr(calibration, "measure_rounds", forced_sequence([1, 0, 1, 0, 1, 0, 1, 0, 1]))
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, VOCAB, 25).tolist(), rng.integers(0, VOCAB, 9).tolist()]
    ar = generate(target, prompts, mode="ar", max_new_tokens=40, eos_token_ids=())
    auto = Generator(target, draft).generate(prompts, max_new_tokens=40, eos_token_ids=())
    assert auto.tokens == ar.tokens
    assert all(r > 0 for r in rounds_of(auto).values())
    assert auto.stats.policy["candidate_runs"] >= 9  # each forced round was a run of its own
    assert sum(rounds_of(auto).values()) == auto.stats.rounds  # each run's rounds, counted at its end


def test_chains_sharing_a_history_and_trees_sharing_a_draft_switch_exactly(target, draft, monkeypatch):
    # Two prompt-lookup chains share one history, two trees of other depths one draft state: a
    # batch of 4 switching among all of them every round or two keeps AR's greedy tokens.
    plan = (("ar", ()), ("pld 1", (1,)), ("pld 6", (1,) * 6), ("tree 2", (2,)), ("tree 3,4,4", (3, 4, 4)))
    adaptive = adaptive_proposer(target, draft, plan)
    assert len(adaptive[0].sources) == 3  # AR's, one prompt lookup, one draft
    monkeypatch.setattr(calibration, "measure_rounds", forced_sequence([3, 1, 4, 2, 0, 3, 2, 1, 4, 0, 4]))
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in (25, 9, 17, 30)]
    ar = generate(target, prompts, mode="ar", max_new_tokens=40, eos_token_ids=())
    generator = Generator(target, draft)
    generator.proposer_for_request = lambda request, batch: adaptive
    auto = generator.generate(prompts, max_new_tokens=40, eos_token_ids=())
    assert auto.tokens == ar.tokens
    assert rounds_of(auto).keys() == dict(plan).keys()
    assert all(r > 0 for r in rounds_of(auto).values()), rounds_of(auto)


def test_plans_put_a_lookup_chain_beside_the_greedy_trees_only():
    names = [n for n, _ in candidate_plan(True, True, 1, lookup_tokens=6)]
    assert names == ["ar", tree_candidate_name(greedy_deep_tree(6), 6)]
    # By default the greedy tree carries a chain of DEFAULT_LOOKUP_TOKENS; 0 turns it off, and mode
    # auto then holds the longspec mode's whole tree, a shallow one and the chain alone.
    assert [n for n, _ in candidate_plan(True, True, 1)] == ["ar", DEEP]
    unchained = ["ar", "pld 10", tree_candidate_name(DEFAULT_WIDTHS), tree_candidate_name(SHALLOW_TREE)]
    assert [n for n, _ in candidate_plan(True, True, 1, lookup_tokens=0)] == unchained
    # The deep tree is the longspec mode's cut level by level to the rows a chain leaves it: with it the
    # chain fills the rows that tree alone takes, down to the tree's first level.
    assert greedy_deep_tree(0) == DEFAULT_WIDTHS
    assert (greedy_deep_tree(16), greedy_deep_tree(32)) == ((4, 16, 16, 11), (4, 16, 11))
    for tokens in (1, 6, DEFAULT_LOOKUP_TOKENS, num_nodes(DEFAULT_WIDTHS) - 1 - DEFAULT_WIDTHS[0]):
        deep = greedy_deep_tree(tokens)
        assert deep == DEFAULT_WIDTHS[: len(deep) - 1] + deep[-1:] and 0 < deep[-1] <= DEFAULT_WIDTHS[len(deep) - 1]
        assert num_nodes(lookup_widths(deep, tokens)) == num_nodes(DEFAULT_WIDTHS)
    assert greedy_deep_tree(num_nodes(DEFAULT_WIDTHS) + 5) == DEFAULT_WIDTHS[:1]
    for greedy, batch in ((False, 1), (True, 4), (False, 8)):  # sampling and large batches: no chain
        assert candidate_plan(True, greedy, batch, lookup_tokens=10) == candidate_plan(True, greedy, batch, 0)
        assert candidate_plan(True, greedy, batch) == candidate_plan(True, greedy, batch, 0)
    assert candidate_plan(False, True, 1, lookup_tokens=10) == candidate_plan(False, True, 1)


def test_generator_resolves_the_lookup_chain_by_mode_and_draft(target, draft):
    """Mode auto with a draft carries the default chain unless told otherwise; a fixed longspec tree,
    or auto without a draft (no tree to put it beside), none unless asked."""
    assert Generator(target, draft).lookup_tokens == DEFAULT_LOOKUP_TOKENS > 0
    assert Generator(target, draft, lookup_tokens=0).lookup_tokens == 0
    assert Generator(target, draft, lookup_tokens=3).lookup_tokens == 3
    assert Generator(target, draft, mode="longspec").lookup_tokens == 0
    assert Generator(target, draft, tree_widths=(2, 2)).lookup_tokens == 0  # a fixed tree: mode longspec
    assert Generator(target).lookup_tokens == 0  # this tiny target ships no draft
    with pytest.raises(UserError, match="no shipped draft"):
        Generator(target, lookup_tokens=3)


def test_a_tree_with_a_lookup_chain_shares_the_draft_and_the_history_and_switches_exactly(target, draft, monkeypatch):
    """The tree with a chain proposes from the draft's state and prompt lookup's history together:
    after its rounds neither catches up, after another candidate's the one it did not use does.
    Switching among all of them every round or two keeps AR's greedy tokens."""
    plan = (("ar", ()), ("pld 6", (1,) * 6), ("tree 2,2+pld 3", (2, 2)), ("tree 3", (3,)))
    adaptive, params = adaptive_proposer(target, draft, plan)
    assert len(adaptive.sources) == 3  # AR's, the prompt lookup's, the draft's
    chained = adaptive.candidates[2]
    assert chained.sources == (2, 1) and chained.depth == 3
    assert [adaptive.waits_out(j, 2) for j in range(3)] == [False, False, False]
    assert [adaptive.waits_out(j, 1) for j in range(3)] == [False, False, True]  # prompt lookup's run
    assert [adaptive.waits_out(j, 3) for j in range(3)] == [False, True, False]  # the plain tree's run
    monkeypatch.setattr(calibration, "measure_rounds", forced_sequence([2, 1, 2, 3, 0, 2, 2, 1, 3, 2, 0, 2]))
    seed = [3, 17, 29, 4, 11]
    # A prompt followed by the target's own continuation, so that some lookups hit.
    batch = [seed + generate(target, [seed], mode="ar", max_new_tokens=20, eos_token_ids=()).tokens[0], seed[:3]]
    ar = generate(target, batch, mode="ar", max_new_tokens=40, eos_token_ids=())
    generator = Generator(target, draft)
    generator.proposer_for_request = lambda request, size: (adaptive, params)
    auto = generator.generate(batch, max_new_tokens=40, eos_token_ids=())
    assert auto.tokens == ar.tokens
    assert all(r > 0 for r in rounds_of(auto).values()), rounds_of(auto)


def test_mode_auto_with_a_lookup_chain_decodes_as_ar(target, draft, monkeypatch):
    monkeypatch.setattr(calibration, "measure_rounds", forced_sequence([1, 1, 0, 1, 0, 1]))
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, VOCAB, 21).tolist(), rng.integers(0, VOCAB, 8).tolist()]
    ar = generate(target, prompts, mode="ar", max_new_tokens=30, eos_token_ids=())
    auto = Generator(target, draft, lookup_tokens=4).generate(prompts, max_new_tokens=30, eos_token_ids=())
    assert auto.tokens == ar.tokens
    assert rounds_of(auto)[tree_candidate_name(greedy_deep_tree(4), 4)] > 0  # the tree with its chain ran


def test_calibration_is_kept_for_the_next_process(target, monkeypatch, tmp_path):
    calls = []
    real = calibration.measure_rounds

    def counting(state, run, candidates):
        calls.append(candidates)
        return real(state, run, candidates)

    monkeypatch.setattr(calibration, "measure_rounds", counting)
    prompt = np.random.default_rng(3).integers(0, VOCAB, 20).tolist()
    first = generate(target, prompt, max_new_tokens=40, eos_token_ids=())
    assert calls == [2] and first.stats.policy["calibration"] == "measured"
    calibration.forget_calibrations()  # what a new process starts with
    second = generate(target, prompt, max_new_tokens=40, eos_token_ids=())
    assert calls == [2] and second.stats.policy["calibration"] == "kept"
    assert (tmp_path / "calibration").is_dir()
    assert second.tokens == first.tokens


@pytest.mark.slow
def test_sampling_that_switches_candidates_matches_the_target_distribution(monkeypatch, tmp_path):
    # Round 1 by prompt lookup, round 2 by AR, round 3 by the draft tree: the first three tokens of a
    # sequence come from whichever rounds its acceptances reached. (A batch this large gets the
    # smallest candidates: a one-token chain and a two-node tree.)
    monkeypatch.setattr(calibration, "measure_rounds", forced_sequence([1, 0, 2]))
    target = sharpened_target(seed=2, vocab_size=SAMPLE_VOCAB, eos_token_ids=())
    draft = init_draft(target, seed=3, config=DraftConfig(window=16))
    prompt = [1, 3, 0, 2, 2]
    result = generate(
        target, [prompt] * SAMPLES, draft=draft, max_new_tokens=3, temperature=1.0, seed=11, eos_token_ids=()
    )
    rounds = rounds_of(result)
    assert rounds["pld 1"] == rounds["ar"] == 1, rounds  # a switch inside the three tokens
    expected = exact_first_three(target, prompt, SamplingParams.create(temperature=1.0)).reshape(-1) * SAMPLES
    tokens = np.asarray(result.tokens)
    observed = np.bincount(
        (tokens[:, 0] * SAMPLE_VOCAB + tokens[:, 1]) * SAMPLE_VOCAB + tokens[:, 2], minlength=SAMPLE_VOCAB**3
    )
    assert observed[expected == 0].sum() == 0
    big = expected >= 5
    small = ~big & (expected > 0)
    obs = np.append(observed[big], observed[small].sum() if small.any() else []).astype(np.float64)
    exp = np.append(expected[big], expected[small].sum() if small.any() else []).astype(np.float64)
    assert stats.chisquare(obs, exp * (obs.sum() / exp.sum())).pvalue > 1e-3


@pytest.mark.parametrize("rounds", [1, 5, 21])  # 21 > the ring's 8 positions: writes wrap around
def test_a_draft_that_sits_out_other_rounds_catches_up_to_the_same_state(target, draft, rounds):
    """The draft's state after `rounds` rounds of another candidate it did not see, caught up once
    from the output, equals what writing each round's pending tokens into the ring and taking the
    next as pending leaves: the same ring (K/V and positions) and the root pending. Two sequences
    with different prompt lengths."""
    from types import SimpleNamespace

    from flax import nnx

    from longspec_jax.proposers import BlockDraft, DraftParams

    graphdef, block_params = nnx.split(draft.block)
    params = DraftParams(block_params)
    proposer = DraftProposer(BlockDraft(graphdef, tree_slots=4, window=draft.config.window), (2, 2), pending_rows=3)
    model = target.decode_model()
    rng = np.random.default_rng(rounds)
    lengths = jnp.asarray([11, 6], jnp.int32)
    prompts = jnp.asarray(rng.integers(0, VOCAB, (2, 11)), jnp.int32)
    out = jnp.asarray(rng.integers(0, VOCAB, (2, rounds + 4)), jnp.int32)  # token i at position length + i
    # Before the run: a tree round kept out[:, :3] (pending, the draft has not seen them).
    state = proposer.init(params, model, SimpleNamespace(lengths=lengths), prompts, lengths, out[:, 0])
    state = proposer.accept(state, out[:, :3], jnp.asarray([3, 3], jnp.int32), lengths)
    kept = 3
    round_by_round = state
    for _ in range(rounds):
        root_pos = lengths + kept - 1
        # What a round of another candidate would have done with the draft's state: its pending
        # tokens (the last of them the root) into the ring, K/V only.
        positions, valid = proposer._pending_positions(round_by_round, root_pos)
        ring = proposer.draft.remember(params, model, round_by_round.draft, round_by_round.pending, positions, valid)
        round_by_round = round_by_round.replace(draft=ring)
        new = out[:, kept : kept + 1]
        round_by_round = proposer.accept(round_by_round, new, jnp.ones((2,), jnp.int32), root_pos + 1)
        kept += 1
    n_out = jnp.full((2,), kept, jnp.int32)
    caught_up = proposer.catch_up(params, model, state, out, n_out, lengths + kept - 1)
    a, b = round_by_round.draft, caught_up.draft
    np.testing.assert_array_equal(np.asarray(a.positions), np.asarray(b.positions))
    np.testing.assert_allclose(np.asarray(a.k, np.float32), np.asarray(b.k, np.float32), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(a.v, np.float32), np.asarray(b.v, np.float32), rtol=1e-6, atol=1e-6)
    assert np.asarray(round_by_round.n_pending).tolist() == np.asarray(caught_up.n_pending).tolist() == [1, 1]
    np.testing.assert_array_equal(np.asarray(round_by_round.pending[:, 0]), np.asarray(out[:, kept - 1]))
    np.testing.assert_array_equal(np.asarray(caught_up.pending[:, 0]), np.asarray(out[:, kept - 1]))


@pytest.mark.parametrize("rounds", [1, 4, 9])
def test_prompt_lookup_that_sits_out_other_rounds_catches_up_to_the_same_history(rounds):
    """Prompt lookup's history after rounds of other candidates (one to three tokens kept each),
    caught up once from the output, equals the history its accept writes round by round, over
    every position up to the root. Two sequences with different prompt lengths."""
    from types import SimpleNamespace

    source = PromptLookup((1, 1))
    rng = np.random.default_rng(rounds)
    lengths = jnp.asarray([11, 6], jnp.int32)
    prompts = jnp.asarray(rng.integers(0, VOCAB, (2, 11)), jnp.int32)
    out = jnp.asarray(rng.integers(0, VOCAB, (2, 40)), jnp.int32)  # token i at position length + i
    cache = SimpleNamespace(max_len=64, lengths=lengths)
    start = source.init((), None, cache, prompts, lengths, out[:, 0])
    history, n_out = start, np.ones(2, np.int32)
    for kept in rng.integers(1, 4, (rounds, 2)):
        tokens = jnp.stack([jax.lax.dynamic_slice(out[b], (int(n_out[b]),), (3,)) for b in range(2)])
        history = source.accept(history, tokens, jnp.asarray(kept, jnp.int32), lengths + jnp.asarray(n_out))
        n_out = n_out + kept
    caught_up = source.catch_up((), None, start, out, jnp.asarray(n_out), lengths + jnp.asarray(n_out) - 1)
    for b in range(2):
        end = int(lengths[b] + n_out[b])  # positions up to the root's
        np.testing.assert_array_equal(np.asarray(caught_up[b, :end]), np.asarray(history[b, :end]))
        assert np.asarray(caught_up[b, end - 1]) == np.asarray(out[b, n_out[b] - 1])  # the root


# ----------------------------------------------------------------------------- remembered acceptance
# Mode auto remembers what each candidate kept per round and starts the next request of the same
# kind from it (acceptance_memory.py, policy.with_memory).

TREE = DEEP  # greedy's deep tree at batch 1
DRAWN_TREE = tree_candidate_name(DRAWN_CHAIN)  # the draft's candidate at T > 0, large batches
COUPLED = tree_candidate_name(COUPLED_TREE)  # ... and below them


def test_with_memory_sets_only_untried_remembered_candidates():
    policy = init_policy(jnp.asarray([1.0, 2.0, 3.0]), max_tokens=[1, 6, 6])
    policy = policy.replace(rounds=jnp.asarray([0, 0, 4], jnp.int32))
    out = with_memory(policy, np.asarray([5.0, 1.5, 4.0]), np.asarray([0, 64, 64]), np.asarray([0, 40, 40]))
    np.testing.assert_allclose(out.tokens_per_round, [1.0, 1.5, policy.tokens_per_round[2]])  # AR stays 1
    assert out.since_used.tolist() == [policy.since_used[0], 0, policy.since_used[2]]  # not due at the start
    assert out.wait.tolist() == [FIRST_WAIT, 64, FIRST_WAIT]
    assert out.evidence.tolist() == [1.0, 40.0, 1.0]  # the remembered rounds weigh its estimate
    unknown = with_memory(policy, np.asarray([np.nan, np.nan, np.nan]), np.zeros(3, np.int32), np.zeros(3))
    assert unknown.tokens_per_round.tolist() == policy.tokens_per_round.tolist()


@struct.dataclass
class _Proposal:
    policy: PolicyState


@struct.dataclass
class _LoopState:
    proposal: _Proposal


def test_a_remembered_estimate_weighs_its_rounds_only_when_sampling():
    # Greedy, what a chain keeps follows the text: the next request's first round decides. When
    # sampling, what a drawn token keeps is the draft's and the target's: dozens of rounds stand.
    names = ("ar", "pld 2", DRAWN_TREE)
    key = acceptance_memory.memory_key(test="weighs")
    entry = {"tokens_per_round": 1.5, "rounds": 500, "wait": 64}
    acceptance_memory.save_memory(key, {"pld 2": entry, DRAWN_TREE: entry}, None)
    state = _LoopState(_Proposal(init_policy(jnp.ones(3), max_tokens=[1, 3, 2])))
    greedy, remembered = acceptance_memory.with_remembered(state, names, key)
    sampled, _ = acceptance_memory.with_remembered(state, names, key, sampled=True)
    assert remembered == ("pld 2", DRAWN_TREE)
    assert greedy.proposal.policy.evidence.tolist() == [1.0, 1.0, 1.0]
    assert sampled.proposal.policy.evidence.tolist() == [1.0, *[float(acceptance_memory.SAMPLED_EVIDENCE)] * 2]
    np.testing.assert_allclose(sampled.proposal.policy.tokens_per_round, [1.0, 1.5, 1.5])
    # Greedy keeps the remembered retry wait; sampling retries a remembered loser after the first.
    assert greedy.proposal.policy.wait.tolist()[1:] == [64, 64]
    assert sampled.proposal.policy.wait.tolist()[1:] == [FIRST_WAIT, FIRST_WAIT]


def test_costs_and_memory_set_in_one_call_as_the_two_in_turn():
    names = ("ar", "pld 2", DRAWN_TREE)
    key = acceptance_memory.memory_key(test="one call")
    acceptance_memory.save_memory(key, {DRAWN_TREE: {"tokens_per_round": 1.7, "rounds": 30, "wait": 32}}, None)
    policy = init_policy(jnp.ones(3), max_tokens=[1, 3, 2]).replace(rounds=jnp.asarray([0, 2, 0], jnp.int32))
    seconds = [0.6e-3, 0.9e-3, 1.2e-3]
    for sampled in (False, True):
        both, remembered = acceptance_memory.with_remembered(
            _LoopState(_Proposal(policy)), names, key, sampled, seconds=seconds
        )
        costed = _LoopState(_Proposal(with_costs(policy, seconds)))
        in_turn, _ = acceptance_memory.with_remembered(costed, names, key, sampled)
        assert remembered == (DRAWN_TREE,)
        for a, b in zip(jax.tree.leaves(both.proposal.policy), jax.tree.leaves(in_turn.proposal.policy)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Nothing remembered: the costs alone are set.
    alone, remembered = acceptance_memory.with_remembered(
        _LoopState(_Proposal(policy)), names, acceptance_memory.memory_key(test="none"), seconds=seconds
    )
    assert remembered == ()
    np.testing.assert_allclose(alone.proposal.policy.seconds_per_round, seconds, rtol=1e-6)
    np.testing.assert_array_equal(alone.proposal.policy.tokens_per_round, with_costs(policy, seconds).tokens_per_round)


def test_when_sampling_a_remembered_loser_wins_its_place_back():
    """The H200 case (T = 1, 2026-12-03): AR 0.663 ms a round, the coupled tree 1.143 ms (it breaks
    even at 1.72 tokens); the memory says the tree kept 1.52 over its 20 calibration rounds, with a
    long wait; it really keeps 2.35. From what `with_remembered` starts a sampled request with, the
    tree is retried and runs from then on; started as the memory used to weigh (64 rounds, the
    remembered wait) it never ran again."""
    from tests.test_policy import simulate

    names, key = ("ar", COUPLED), acceptance_memory.memory_key(test="loser")
    entry = {"tokens_per_round": 1.52, "rounds": 64, "wait": 256}
    acceptance_memory.save_memory(key, {COUPLED: entry}, None)
    policy = with_costs(init_policy(jnp.ones(2), max_tokens=[1, 4]), [0.663, 1.143])
    start, _ = acceptance_memory.with_remembered(_LoopState(_Proposal(policy)), names, key, sampled=True)
    rng = np.random.default_rng(0)
    kept = rng.choice([1, 2, 3, 4], 128, p=[0.35, 0.2, 0.2, 0.25])
    tokens = np.stack([np.ones(128), kept], 1).astype(np.int32)
    _, chosen = simulate(start.proposal.policy, tokens, True)
    assert (np.asarray(chosen)[32:] == 1).mean() > 0.9, np.asarray(chosen)
    before = with_memory(policy, np.asarray([np.nan, 1.52]), np.asarray([0, 256]), np.asarray([0, 64]))
    _, chosen = simulate(before, tokens, True)
    assert (np.asarray(chosen) == AR).all()


def test_a_losing_draft_is_not_tried_again_at_the_next_requests_start(target, draft, monkeypatch):
    monkeypatch.setattr(calibration, "measure_rounds", fixed_costs(dict(zip(("ar", *UNCHAINED), (1.0, 3.0, 3.0, 2.5)))))
    generator = Generator(target, draft, lookup_tokens=0)  # three candidates besides AR
    prompt = np.random.default_rng(1).integers(0, VOCAB, 30).tolist()
    ar = generate(target, prompt, mode="ar", max_new_tokens=40, eos_token_ids=())
    first = generator.generate(prompt, max_new_tokens=40, eos_token_ids=())
    second = generator.generate(prompt, max_new_tokens=40, eos_token_ids=())
    assert first.tokens == second.tokens == ar.tokens
    assert first.stats.policy["remembered"] == []
    assert second.stats.policy["remembered"] == list(UNCHAINED)
    before, after = rounds_of(first), rounds_of(second)
    losers = UNCHAINED
    assert all(before[name] >= 1 for name in losers)  # tried at the start of the first request
    assert all(after[name] < before[name] for name in losers), (before, after)
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
    adaptive = Adaptive((NoProposal(), tree), (Candidate("ar", (0,), NoProposal()), Candidate(name, (1,), tree)))
    generator = Generator(target, mode="ar")
    generator.proposer_for_request = lambda request, batch: (adaptive, ((), jnp.asarray(known)))
    request = DecodeRequest(max_new_tokens=max_new, sampling=SamplingSettings(), seed=0, eos_token_ids=())
    generator.decode([prompt], request)
    second = generator.decode([prompt], request)
    assert second.tokens == reference
    assert second.stats.policy["remembered"] == [name]
    assert rounds_of(second)["ar"] == 0  # no first trial of AR against a tree remembered to win


def test_memory_is_kept_on_disk_and_keyed_by_the_sampling(target, draft, monkeypatch, tmp_path):
    monkeypatch.setattr(calibration, "measure_rounds", fixed_costs({"ar": 1.0, TREE: 3.0}))
    prompt = np.random.default_rng(2).integers(0, VOCAB, 30).tolist()
    generate(target, prompt, draft=draft, max_new_tokens=24, eos_token_ids=())
    files = list((tmp_path / "acceptance").glob("*.json"))
    assert len(files) == 1
    entries = json.loads(files[0].read_text())["candidates"]
    assert set(entries) == {TREE} and all(e["tokens_per_round"] >= 1.0 for e in entries.values())
    acceptance_memory.forget_memory()  # what a new process starts with
    again = generate(target, prompt, draft=draft, max_new_tokens=24, eos_token_ids=())
    assert again.stats.policy["remembered"] == [TREE]
    monkeypatch.setattr(calibration, "measure_rounds", fixed_costs({"ar": 1.0, COUPLED: 3.0}))
    sampled = generate(target, prompt, draft=draft, max_new_tokens=24, temperature=0.7, eos_token_ids=())
    assert sampled.stats.policy["remembered"] == []  # another kind of request


def test_a_damaged_memory_file_is_ignored(target, draft, monkeypatch, tmp_path):
    monkeypatch.setattr(calibration, "measure_rounds", fixed_costs({"ar": 1.0, TREE: 3.0}))
    prompt = np.random.default_rng(2).integers(0, VOCAB, 30).tolist()
    first = generate(target, prompt, draft=draft, max_new_tokens=24, eos_token_ids=())
    (path,) = (tmp_path / "acceptance").glob("*.json")
    path.write_text('{"candidates": {"pld 10": {"tokens_per_round": "many"}, "tree": 3}}')
    acceptance_memory.forget_memory()
    again = generate(target, prompt, draft=draft, max_new_tokens=24, eos_token_ids=())
    assert again.stats.policy["remembered"] == [] and again.tokens == first.tokens


def test_the_fingerprint_tells_weights_of_one_shape_apart(target):
    a = init_draft(target, seed=5, config=DraftConfig(window=8))
    b = init_draft(target, seed=6, config=DraftConfig(window=8))
    fa, fb = (acceptance_memory.weights_fingerprint(nnx.state(d.block)) for d in (a, b))
    assert fa != fb and fa == acceptance_memory.weights_fingerprint(nnx.state(a.block))


def test_the_memory_file_is_rewritten_at_most_every_few_seconds(tmp_path):
    now = [100.0]
    clock = lambda: now[0]  # noqa: E731
    entry = lambda t: {"pld": {"tokens_per_round": t, "rounds": 4, "wait": 8}}  # noqa: E731
    on_disk = lambda: json.loads((tmp_path / "k.json").read_text())["candidates"]["pld"]["tokens_per_round"]  # noqa: E731
    acceptance_memory.save_memory("k", entry(2.0), tmp_path, clock=clock)
    assert on_disk() == 2.0  # a key's first save is written at once
    now[0] += 1.0
    acceptance_memory.save_memory("k", entry(3.0), tmp_path, clock=clock)
    assert on_disk() == 2.0 and acceptance_memory.load_memory("k", tmp_path)["pld"]["tokens_per_round"] == 3.0
    now[0] += acceptance_memory.SAVE_EVERY_S
    acceptance_memory.save_memory("k", entry(4.0), tmp_path, clock=clock)
    assert on_disk() == 4.0
    now[0] += 1.0
    acceptance_memory.save_memory("k", entry(5.0), tmp_path, clock=clock)
    acceptance_memory.flush_memory()  # as when the process exits
    assert on_disk() == 5.0


def test_a_memory_snapshot_is_a_copy_and_restores_exactly():
    entry = {"tokens_per_round": 2.5, "rounds": 12, "wait": 8}
    acceptance_memory.save_memory("kind", {"pld 10": entry}, None)
    snapshot = acceptance_memory.memory_snapshot()
    acceptance_memory.save_memory("kind", {"pld 10": {**entry, "rounds": 40}}, None)
    acceptance_memory.save_memory("other kind", {TREE: entry}, None)
    assert snapshot == {"kind": {"pld 10": entry}}  # later requests do not reach into it
    acceptance_memory.restore_memory(snapshot)
    assert acceptance_memory.load_memory("kind", None) == {"pld 10": entry}
    assert acceptance_memory.load_memory("other kind", None) == {}


def test_the_unmeasured_setup_leaves_the_initial_policy_as_it_is():
    # A request that measures its costs starts its policy through the same start call as one with
    # kept costs: the set-up it passes must change nothing before the measuring rounds.
    policy = init_policy(jnp.ones(3), max_tokens=[1, 3, 2])
    setup = calibration.unmeasured_setup(3)
    set_up = with_costs_and_memory(policy, setup[0], setup[1], setup[2].astype(np.int32), setup[3])
    for a, b in zip(jax.tree.leaves(set_up), jax.tree.leaves(policy)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_request_with_kept_costs_sets_its_policy_in_the_start_call(target, draft, monkeypatch):
    # The first request of a kind measures the costs and then sets them and the memory by a call of
    # their own; a later one finds them kept and passes them to the start call instead.
    monkeypatch.setattr(calibration, "measure_rounds", fixed_costs({"ar": 1e-3, DEEP: 1.5e-3}))
    calls = []
    original = generation_module.with_remembered
    monkeypatch.setattr(generation_module, "with_remembered", lambda *a, **k: calls.append(1) or original(*a, **k))
    rng = np.random.default_rng(6)
    prompt = [rng.integers(0, VOCAB, 30).tolist()]
    ar = generate(target, prompt, mode="ar", max_new_tokens=30, eos_token_ids=())
    generator = Generator(target, draft)
    first = generator.generate(prompt, max_new_tokens=30, eos_token_ids=())
    assert first.stats.policy["calibration"] == "measured" and len(calls) == 1
    second = generator.generate(prompt, max_new_tokens=30, eos_token_ids=())
    assert second.stats.policy["calibration"] == "kept" and len(calls) == 1
    assert second.stats.policy["remembered"] == [DEEP]  # the first request's rounds, set in the start call
    costs = [c["ms_per_round"] for c in second.stats.policy["candidates"].values()]
    assert costs == pytest.approx([1.0, 1.5])
    assert first.tokens == second.tokens == ar.tokens
