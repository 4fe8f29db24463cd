"""The speculative modes (decode_loop.py with proposers.py's pld and longspec proposers) end to end
on tiny random float32 targets.

Greedy: every mode must reproduce AR token for token. Sampling: the joint distribution of the first
three tokens over a large batch of one prompt must match the target's exact distribution.
"""

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from longspec_jax.decode_kit import SMALL_BUCKETS_UP_TO, StopRule, cache_bytes, compiled, prefill
from longspec_jax.decode_loop import LoopConfig, decode, propose, start, started
from longspec_jax.draft import DraftConfig, candidates_from_logits, draft_hidden
from longspec_jax.draft_io import init_draft
from longspec_jax.errors import UserError
from longspec_jax.generation import DecodeRequest, Generator, generate
from longspec_jax.model import init_cache
from longspec_jax.proposers import DraftProposer, proposer_for
from longspec_jax.round_profile import _repeat_propose, _repeat_verify, profile_round, profile_round_parts
from longspec_jax.sampling import SamplingParams, SamplingSettings, filtered_log_probs
from longspec_jax.target import random_target
from longspec_jax.tree import node_depths
from tests.tiny_models import tiny_config

WIDTHS = (3, 4, 4)  # small tree: depth 3, 12 nodes + root


def sharpened_target(seed=0, **config):
    """A tiny random target with matrices scaled to std ~0.2: O(1) logits, no near-ties in argmax."""
    target = random_target(tiny_config(**config), seed=seed, dtype="float32")
    _, params = nnx.split(target.model)
    nnx.update(target.model, jax.tree.map(lambda x: x * 10.0 if x.ndim == 2 else x, params))
    return target


@pytest.fixture(scope="module")
def target():
    return sharpened_target(vocab_size=48, eos_token_ids=())


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(0, 48, size=13).tolist(), rng.integers(0, 48, size=6).tolist()]


MAX_NEW = 16  # every test stays in one output bucket, so the compiled programs are shared


def ar(target, prompts, max_new=MAX_NEW):
    return generate(target, prompts, mode="ar", max_new_tokens=max_new, eos_token_ids=()).tokens


@pytest.fixture(scope="module")
def reference(target, prompts):
    """AR greedy output of `prompts`, MAX_NEW tokens each: shorter runs are its prefixes."""
    return ar(target, prompts)


def cut_at(tokens, eos):
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


@dataclasses.dataclass(frozen=True)
class OracleDraft:
    """A stand-in draft that knows the greedy continuation (its parameters: int32[B, S], each
    prompt followed by its AR output) and predicts the token at position p + 1 for a query at
    p, except for a fixed pseudo-random ~15% of (position, token) pairs where it guesses wrong.
    Off-path tree nodes get the same guess, which is simply wrong there, as a real draft would be."""

    vocab: int
    window: int = 8  # the ring a real draft keeps (catch_up writes at most this many tokens)

    def init_state(self, params, batch):
        return jnp.zeros((batch, 1), jnp.int32)

    def prefill(self, params, target_model, state, tokens, lengths):
        return state

    def _logits(self, params, tokens, positions):
        right = jnp.take_along_axis(params, jnp.clip(positions + 1, 0, params.shape[1] - 1), axis=1)
        wrong = (positions * 7919 + tokens * 104729) % 100 < 15
        guess = jnp.where(wrong, (right + 1) % self.vocab, right)
        return 6.0 * jax.nn.one_hot(guess, self.vocab) + 0.1 * jax.nn.one_hot((guess + 2) % self.vocab, self.vocab)

    def commit(self, params, target_model, state, tokens, positions, valid, target_k, target_v, attn_impl):
        return self._logits(params, tokens, positions), state

    def remember(self, params, target_model, state, tokens, positions, valid):
        return state

    def propose_level(
        self, params, target_model, state, tokens, depth, sees, root_positions, target_k, target_v, attn_impl
    ):
        return self._logits(params, tokens, root_positions[:, None] + depth), state

    def candidates(self, params, target_model, logits, k, attn_impl, sampling, noise, scaled_noise=None):
        return candidates_from_logits(logits, k, sampling, noise)  # its features are its logits

    def logits(self, params, target_model, logits):
        return logits


def oracle_generate(target, prompts, reference, max_new, eos=()):
    """Greedy longspec with the oracle draft."""
    known = np.zeros((len(prompts), max(map(len, prompts)) + MAX_NEW), np.int32)
    for b, (p, out) in enumerate(zip(prompts, reference)):
        known[b, : len(p) + len(out)] = p + out
    generator = Generator(target, mode="ar", attn_impl="xla")
    generator.proposer = DraftProposer(OracleDraft(target.config.vocab_size), WIDTHS)
    generator.proposer_params = jnp.asarray(known)
    request = DecodeRequest(max_new_tokens=max_new, sampling=SamplingSettings(), seed=0, eos_token_ids=tuple(eos))
    return generator.decode(prompts, request)


@pytest.fixture(scope="module")
def draft(target):
    """A random draft with a ring of 8 slots (prompts wrap it) and O(1) logits (matrices x10)."""
    draft = init_draft(target, seed=1, config=DraftConfig(window=8))
    _, draft_vars = nnx.split(draft.block)
    nnx.update(draft.block, jax.tree.map(lambda x: x * 10.0 if x.ndim == 2 else x, draft_vars))
    return draft


@pytest.fixture(scope="module")
def random_draft_result(target, prompts, draft):
    return generate(
        target, prompts, mode="longspec", draft=draft, tree_widths=WIDTHS, max_new_tokens=10, eos_token_ids=()
    )


def test_longspec_greedy_with_random_draft_equals_ar(random_draft_result, reference):
    assert random_draft_result.tokens == [r[:10] for r in reference]
    assert random_draft_result.stats.rounds >= 1 and random_draft_result.stats.tau >= 1.0


def test_streaming_runs_the_same_loop_in_chunks(target, prompts, draft, random_draft_result):
    chunks = []
    result = generate(
        target,
        prompts,
        mode="longspec",
        draft=draft,
        tree_widths=WIDTHS,
        max_new_tokens=10,
        eos_token_ids=(),
        stream=chunks.append,
        stream_every=1,  # one round per chunk: a call never runs fewer than one
    )
    assert result.tokens == random_draft_result.tokens
    assert len(chunks) == result.stats.rounds and chunks[-1] == result.tokens
    for earlier, later in zip(chunks, chunks[1:]):
        assert all(later_seq[: len(seq)] == seq for seq, later_seq in zip(earlier, later))


def test_longspec_greedy_with_oracle_draft_equals_ar_with_long_paths(target, prompts, reference):
    result = oracle_generate(target, prompts, reference, MAX_NEW)
    assert result.tokens == reference
    assert result.stats.tau > 2.0  # long accepted paths really happened
    assert result.stats.rounds < MAX_NEW // 2


def test_longspec_greedy_drawn_chain_equals_ar(target, prompts, reference):
    """A chain (every width 1) is drawn from the draft; greedy, the draw is its argmax and the
    verification keeps exactly what the target's argmax agrees with."""
    known = np.zeros((len(prompts), max(map(len, prompts)) + MAX_NEW), np.int32)
    for b, (p, out) in enumerate(zip(prompts, reference)):
        known[b, : len(p) + len(out)] = p + out
    generator = Generator(target, mode="ar", attn_impl="xla")
    generator.proposer = DraftProposer(OracleDraft(target.config.vocab_size), (1, 1, 1))
    generator.proposer_params = jnp.asarray(known)
    request = DecodeRequest(max_new_tokens=MAX_NEW, sampling=SamplingSettings(), seed=0, eos_token_ids=())
    result = generator.decode(prompts, request)
    assert result.tokens == reference
    assert result.stats.tau > 2.0


def test_longspec_eos_inside_an_accepted_path(target, prompts, reference):
    eos = reference[0][7]  # mid-way through sequence 0, inside a round when paths are long
    result = oracle_generate(target, prompts, reference, MAX_NEW, eos=(eos,))
    expected = [cut_at(r, eos) for r in reference]
    assert result.tokens == expected
    assert expected[0][-1] == eos and len(expected[0]) <= 8


@pytest.mark.parametrize("max_new", [2, 6, 9])
def test_longspec_max_new_tokens_is_exact(target, prompts, reference, max_new):
    result = oracle_generate(target, prompts, reference, max_new)
    assert result.tokens == [r[:max_new] for r in reference]


def test_pld_greedy_equals_ar(target, prompts):
    # The first prompt is followed by the target's own earlier output, so some lookups hit.
    seed = [3, 17, 29, 4, 40]
    batch = [seed + ar(target, [seed], 11)[0], prompts[1]]
    result = generate(target, batch, mode="pld", tree_widths=(1,) * 5, max_new_tokens=12, eos_token_ids=())
    assert result.tokens == [r[:12] for r in ar(target, batch)]
    assert result.stats.tau > 1.0  # some candidates were accepted
    assert result.stats.draft_cache_bytes == 0


def test_a_lookup_chain_beside_the_tree_is_exact_and_keeps_more_on_text_that_repeats(target, prompts, draft):
    """Greedy longspec with a prompt-lookup chain beside its tree equals AR, and on a prompt
    followed by the target's own continuation (some lookups hit) it keeps more a round than the
    tree alone: this random draft's tree keeps nothing here, so what more is kept is the chain's."""
    seed = [3, 17, 29, 4, 40]
    batch = [seed + ar(target, [seed], 11)[0], prompts[1]]
    common = dict(mode="longspec", draft=draft, tree_widths=WIDTHS, max_new_tokens=12, eos_token_ids=())
    alone = generate(target, batch, **common)
    with_chain = generate(target, batch, lookup_tokens=5, **common)
    expected = [r[:12] for r in ar(target, batch)]
    assert alone.tokens == expected and with_chain.tokens == expected
    assert alone.stats.tau == 1.0 and with_chain.stats.tau > 1.0


def test_draft_cache_bytes_do_not_depend_on_prompt_length(target, draft, random_draft_result):
    """The loop's initial state for a 100-token and a 4000-token prompt (shapes only, eval_shape),
    and the bytes a real run reports."""
    proposer, draft_params = proposer_for("longspec", target, draft, WIDTHS)
    graphdef, params = nnx.split(target.model)
    config = LoopConfig(graphdef, proposer, MAX_NEW, "xla")

    def state_bytes(prompt_len):
        bucket = -(-prompt_len // SMALL_BUCKETS_UP_TO) * SMALL_BUCKETS_UP_TO
        cache = jax.eval_shape(lambda: init_cache(target.config, 2, bucket + MAX_NEW + 13, jnp.float32))
        state = started(
            functools.partial(jax.eval_shape, functools.partial(start, config=config)),
            params,
            draft_params,
            cache,
            jax.ShapeDtypeStruct((2, bucket), jnp.int32),
            jax.ShapeDtypeStruct((2,), jnp.int32),
            jax.ShapeDtypeStruct((2, target.config.vocab_size), jnp.float32),
            SamplingParams.create(),
            jax.random.key(0),
            StopRule.create((), MAX_NEW),
        )
        return cache_bytes(state.proposal.draft), cache_bytes(state.cache)

    short_draft, short_target = state_bytes(100)
    long_draft, long_target = state_bytes(4000)
    assert short_draft == long_draft > 0
    assert long_target > 10 * short_target  # the prompt length did reach the shapes
    assert random_draft_result.stats.draft_cache_bytes == short_draft


# --- sampling ------------------------------------------------------------------------------------

SAMPLE_VOCAB = 4
SAMPLES = 4000


def exact_first_three(target, prompt, sampling):
    """numpy: the exact joint distribution [V, V, V] of the first three sampled tokens."""
    v = SAMPLE_VOCAB
    seqs = [prompt + list(c) for c in itertools.product(range(v), repeat=2)]
    logits = np.asarray(target.forward_logits(jnp.asarray(seqs)))  # [V*V, L+2, V]
    probs = lambda x: np.exp(np.asarray(filtered_log_probs(jnp.asarray(x), sampling)))
    n = len(prompt)
    p1 = probs(logits[0, n - 1])
    p2 = probs(logits[:, n].reshape(v, v, v)[:, 0])  # [x1, x2]: the row of any (x1, *) sequence
    p3 = probs(logits[:, n + 1].reshape(v, v, v))  # [x1, x2, x3]
    return p1[:, None, None] * p2[:, :, None] * p3


@pytest.mark.parametrize(
    "temperature,top_p,widths,candidates,lookup,head",
    # (1, 1): a chain drawn from the draft, verified by speculative sampling. candidates: the
    # draft's candidate tokens (None: all), here leaving out token 2, which the target does pick.
    # lookup: a prompt-lookup chain beside the tree, one depth deeper than the tree (the prompt
    # repeats its tokens, so the chain holds some). head: how the draft reads the LM head
    # (draft_head.py; int8: the drawn chain's acceptance test must use the int8 rows' distribution;
    # int8+block: its block's matrices int8 too, int8_rows.py).
    [
        (1.0, 1.0, (2, 2), None, 0, "auto"),
        (0.7, 1.0, (2, 2), None, 0, "auto"),
        (1.0, 0.8, (2, 2), None, 0, "auto"),
        (1.0, 1.0, (1, 1), None, 0, "auto"),
        (0.7, 0.8, (1, 1), None, 0, "auto"),
        (1.0, 1.0, (2, 2), (0, 1, 3), 0, "auto"),
        (0.7, 0.8, (1, 1), (0, 1, 3), 0, "auto"),
        (1.0, 1.0, (2, 2), None, 3, "auto"),
        (1.0, 1.0, (1, 1), None, 0, "int8"),
        (0.7, 1.0, (2, 2), (0, 1, 3), 0, "int8"),
        (1.0, 1.0, (1, 1), None, 0, "int8+block"),
    ],
)
def test_longspec_sampling_first_three_tokens_match_target(temperature, top_p, widths, candidates, lookup, head):
    target = sharpened_target(seed=2, vocab_size=SAMPLE_VOCAB, eos_token_ids=())
    draft = init_draft(target, seed=3, config=DraftConfig(window=16))  # a small ring: the batch is large
    draft = draft.with_candidate_tokens(candidates).with_head_format(head.removesuffix("+block"))
    draft = draft.with_block_format("int8" if head.endswith("+block") else "auto")
    prompt = [1, 3, 0, 2, 2]
    result = generate(
        target,
        [prompt] * SAMPLES,
        mode="longspec",
        draft=draft,
        tree_widths=widths,
        lookup_tokens=lookup,
        max_new_tokens=3,
        temperature=temperature,
        top_p=top_p,
        seed=7,
        eos_token_ids=(),
    )
    sampling = SamplingParams.create(temperature=temperature, top_p=top_p)
    expected = exact_first_three(target, prompt, sampling).reshape(-1) * SAMPLES
    tokens = np.asarray(result.tokens)
    observed = np.bincount(
        (tokens[:, 0] * SAMPLE_VOCAB + tokens[:, 1]) * SAMPLE_VOCAB + tokens[:, 2], minlength=SAMPLE_VOCAB**3
    )
    assert observed[expected == 0].sum() == 0
    if candidates is not None:  # the target often picks what the draft can never propose
        outside = np.isin(np.arange(SAMPLE_VOCAB**3) // SAMPLE_VOCAB**2, candidates, invert=True)
        assert expected[outside].sum() > 0.1 * SAMPLES
    # Cells expected below 5 are pooled into one (chi-square needs it), if there are any.
    big = expected >= 5
    small = ~big & (expected > 0)
    obs = np.append(observed[big], observed[small].sum() if small.any() else []).astype(np.float64)
    exp = np.append(expected[big], expected[small].sum() if small.any() else []).astype(np.float64)
    assert stats.chisquare(obs, exp * (obs.sum() / exp.sum())).pvalue > 1e-3
    assert result.stats.tau > 1.2  # the draft's tree nodes were really accepted


# --- bad input -----------------------------------------------------------------------------------


def test_bad_inputs_raise_user_errors(target):
    draft = init_draft(target, seed=1)
    with pytest.raises(UserError, match="exceeds"):
        generate(target, [1, 2], mode="longspec", draft=draft, tree_widths=(64, 2), max_new_tokens=2)
    with pytest.raises(UserError, match="at most 128"):
        generate(target, [1, 2], mode="longspec", draft=draft, tree_widths=(16,) * 9, max_new_tokens=2)
    with pytest.raises(UserError, match="all be 1"):
        generate(target, [1, 2], mode="pld", tree_widths=(1, 2), max_new_tokens=2)
    with pytest.raises(UserError, match="needs a draft"):
        generate(target, [1, 2], mode="longspec", max_new_tokens=2)
    for mode in ("pld", "ar"):
        with pytest.raises(UserError, match="beside a draft's tree"):
            generate(target, [1, 2], mode=mode, lookup_tokens=3, max_new_tokens=2)
    with pytest.raises(UserError, match="a token count"):
        generate(target, [1, 2], mode="longspec", draft=draft, lookup_tokens=-2, max_new_tokens=2)
    with pytest.raises(UserError, match="drawn from the draft"):
        generate(target, [1, 2], mode="longspec", draft=draft, tree_widths=(1, 1), lookup_tokens=3, max_new_tokens=2)
    with pytest.raises(UserError, match="lookup chain of 10 tokens make 130 nodes"):
        generate(target, [1, 2], draft=draft, tree_widths=(16,) * 7 + (7,), lookup_tokens=10, max_new_tokens=2)
    other = random_target(tiny_config(hidden_size=32, vocab_size=48), seed=0)
    with pytest.raises(UserError, match="different target"):
        generate(target, [1, 2], mode="longspec", draft=init_draft(other), max_new_tokens=2)


# --- the draft's wiring inside a round -----------------------------------------------------------


def loop_start_args(target, prompts, draft):
    """(the loop's config, `start`'s arguments: the greedy state after prefill of `prompts`, bucket
    16), with the programs `generate` compiled for `random_draft_result` (same shapes and statics)."""
    graphdef, params = nnx.split(target.model)
    config, draft_params = loop_config(target, draft)
    tokens = np.zeros((2, 16), np.int32)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = p
    tokens, lengths = jnp.asarray(tokens), jnp.asarray([len(p) for p in prompts], jnp.int32)
    run_prefill, _ = compiled(
        prefill, params, tokens, lengths, graphdef=graphdef, max_len=16 + MAX_NEW + 13, attn_impl="xla"
    )
    last_logits, cache = run_prefill(params, tokens, lengths)
    sampling, key, stop = SamplingParams.create(), jax.random.key(0), StopRule.create((), MAX_NEW)
    return config, (params, draft_params, cache, tokens, lengths, last_logits, sampling, key, stop)


def loop_start(target, prompts, draft):
    """The loop's initial greedy state after prefill of `prompts` (`loop_start_args`)."""
    config, start_args = loop_start_args(target, prompts, draft)
    run_start, _ = compiled(start, *start_args, config=config)
    return started(run_start, *start_args)


def test_start_reads_the_cache_and_leaves_it_to_the_loop(target, prompts, draft):
    """`start` neither donates nor returns the target's cache (each array it passed through cost a
    request host work at both ends of the call): its state comes back without one, the cache it
    read is still alive, and `started` puts that same cache into the state the loop then takes."""
    config, start_args = loop_start_args(target, prompts, draft)
    run_start, _ = compiled(start, *start_args, config=config)
    cache = start_args[2]
    bare = run_start(*start_args)
    assert bare.cache is None and bare.proposal is not None
    assert not any(x.is_deleted() for x in jax.tree.leaves(cache))
    state = started(run_start, *start_args)
    assert state.cache is cache and int(state.n_new[0]) == 1


def loop_config(target, draft):
    """(the loop's static config for longspec with `draft` and WIDTHS, the draft's parameters)."""
    proposer, draft_params = proposer_for("longspec", target, draft, WIDTHS)
    return LoopConfig(nnx.graphdef(target.model), proposer, MAX_NEW, "xla"), draft_params


def test_profile_parts_are_the_loops_rounds_updating_buffers_in_place(target, prompts, draft, random_draft_result):
    """profile_round_parts runs a round as three programs: once each (n = 1) they must reach the
    state the loop reaches (same tokens, cache, draft state); repeated (n = 3), draft and verify
    must redo the same work (same tree, logits and cache: the repetitions are not a different
    computation). Each consumes the buffers it updates: JAX deletes a donated input only when the
    program really reuses it for an output, so the target cache was written in place, not copied
    (a copy per part made the parts outweigh the round on the H200)."""
    params = nnx.state(target.model)
    config, draft_params = loop_config(target, draft)
    sampling = SamplingParams.create()
    rounds = 3

    looped = loop_start(target, prompts, draft)
    stop_at = jnp.asarray(rounds, jnp.int32)
    run_decode, _ = compiled(decode, params, draft_params, looped, stop_at, sampling, config=config)
    looped = run_decode(params, draft_params, looped, stop_at, sampling)

    state = loop_start(target, prompts, draft)
    donated = jax.tree.leaves((state.cache, state.proposal, state.out))
    for _ in range(rounds):
        seconds, state = profile_round_parts(config, params, draft_params, state, sampling, n=1)
    assert all(x.is_deleted() for x in donated)
    assert len(seconds) == 3 and all(np.isfinite(t) and t > 0 for t in seconds)
    for name in ("rounds", "out", "roots", "n_new", "done", "active_rounds"):
        np.testing.assert_array_equal(getattr(state, name), getattr(looped, name), err_msg=name)
    for name in ("pending", "n_pending"):
        np.testing.assert_array_equal(getattr(state.proposal, name), getattr(looped.proposal, name), err_msg=name)
    np.testing.assert_array_equal(state.cache.lengths, looped.cache.lengths)
    assert int((looped.n_new - 1).sum()) >= 2 * rounds  # every round emitted for both sequences
    for got, want in zip(
        jax.tree.leaves((state.cache, state.proposal.draft)), jax.tree.leaves((looped.cache, looped.proposal.draft))
    ):
        np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), atol=1e-5, rtol=1e-5)

    # n repetitions inside one program == n chained one-repetition programs (the loop repeats the part).
    rest = looped.replace(proposal=None)
    copy = lambda tree: jax.tree.map(jnp.copy, tree)  # noqa: E731 (the programs donate their inputs)
    one, three = jnp.asarray(1), jnp.asarray(3)
    chained = (None, copy(looped.proposal))
    for _ in range(3):
        chained = _repeat_propose(params, draft_params, rest, chained[1], sampling, one, config=config)
    repeated = _repeat_propose(params, draft_params, rest, copy(looped.proposal), sampling, three, config=config)
    assert_trees_close(repeated, chained)
    tree = repeated[0]
    chained = (None, copy(looped.cache))
    for _ in range(3):
        chained = _repeat_verify(params, tree, chained[1], one, config=config)
    assert_trees_close(_repeat_verify(params, tree, copy(looped.cache), three, config=config), chained)


def assert_trees_close(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), atol=1e-5, rtol=1e-5)


def test_profile_round_reports_per_repetition_milliseconds(target, prompts, draft, random_draft_result):
    config, draft_params = loop_config(target, draft)
    parts, state = profile_round(
        config,
        nnx.state(target.model),
        draft_params,
        loop_start(target, prompts, draft),
        SamplingParams.create(),
        repeats=2,
    )
    assert set(parts) == {"step_alone_ms", "draft_ms", "verify_ms", "accept_ms", "parts_sum_ms"}
    assert all(np.isfinite(v) and v > 0 for v in parts.values())
    assert parts["parts_sum_ms"] == pytest.approx(parts["draft_ms"] + parts["verify_ms"] + parts["accept_ms"])
    assert int(state.rounds) == 2 * (1 + 2)  # alone: a warm-up and two; parts: a warm-up and two


def test_tree_scores_match_the_draft_training_forward_on_each_chain(target, prompts, draft, random_draft_result):
    """After two rounds (ring of 8 slots already wrapped, per-sequence lengths), every tree node's
    cumulative draft log-prob == the sum along its chain of the draft's full-sequence forward, where
    the query at tree depth d sees the target prefix [0, root position), i.e. flash-noisy lag d + 1.
    (The programs are the ones `random_draft_result` compiled: same shapes and statics.)"""
    graphdef, params = nnx.split(target.model)
    config, draft_params = loop_config(target, draft)
    sampling = SamplingParams.create()
    state = loop_start(target, prompts, draft)
    stop_at = jnp.asarray(2, jnp.int32)
    run_decode, _ = compiled(decode, params, draft_params, state, stop_at, sampling, config=config)
    state = run_decode(params, draft_params, state, stop_at, sampling)
    tree, _ = jax.jit(lambda p, dp, s: propose(config, dp, nnx.merge(graphdef, p), s, sampling))(
        params, draft_params, state
    )

    assert int(state.rounds) == 2 and int(state.cache.lengths.max()) > 8  # the ring has wrapped
    depths = node_depths(WIDTHS)
    _, draft_vars = nnx.split(draft.block)
    for b in range(2):
        root_pos = int(state.cache.lengths[b])
        prefix = prompts[b] + [int(t) for t in state.out[b, : int(state.n_new[b])]]
        assert len(prefix) == root_pos + 1
        node_tokens, parents = np.asarray(tree.tokens[b]), np.asarray(tree.parents[b])

        def chain(i, node_tokens=node_tokens, parents=parents, prefix=prefix):
            out = []
            while i > 0:
                out.append(int(node_tokens[i]))
                i = parents[i]
            return prefix + out[::-1]

        expected = np.zeros(len(node_tokens))
        for parent in range(len(node_tokens)):
            children = np.flatnonzero(parents == parent)
            if not len(children):
                continue
            seq = chain(parent)
            log_probs = chain_log_probs(
                graphdef,
                nnx.graphdef(draft.block),
                params,
                draft_vars,
                jnp.asarray([seq + [0] * (CHAIN_LEN - len(seq))], jnp.int32),
                len(seq) - 1,
                int(depths[parent]) + 1,
            )
            expected[children] = expected[parent] + np.asarray(log_probs)[node_tokens[children]]
        assert np.ptp(expected[1:]) > 1.0  # confident, distinct scores: a wiring slip would show
        np.testing.assert_allclose(np.asarray(tree.scores[b]), expected, atol=2e-3, rtol=1e-4)


CHAIN_LEN = 48  # chains are right-padded to one length (every forward here is causal) to compile once


@functools.partial(jax.jit, static_argnums=(0, 1))
def chain_log_probs(target_graphdef, draft_graphdef, target_params, draft_params, seq, last, lag):
    """The draft's log-probs float32[V] at position `last` of seq int32[1, CHAIN_LEN] by the
    training forward: target last-layer K/V of the whole chain, flash-noisy lag `lag`."""
    model, block = nnx.merge(target_graphdef, target_params), nnx.merge(draft_graphdef, draft_params)
    positions = jnp.arange(seq.shape[1], dtype=jnp.int32)[None, :]
    target_k, target_v = model.last_layer_kv(seq, positions, attn_impl="xla")
    hidden = draft_hidden(block, model, seq, positions, target_k, target_v, lag)
    return jax.nn.log_softmax(model.lm_logits(hidden)[0, last])


def test_auto_mode_uses_a_shipped_draft(target, prompts, draft, reference, tmp_path):
    assert Generator(target).draft is None  # nothing shipped for this target: auto adapts AR and PLD
    draft.save(tmp_path / "shipped")
    shipped = sharpened_target(vocab_size=48, eos_token_ids=())  # the same weights as `target`
    shipped.shipped_draft = tmp_path / "shipped"
    auto = Generator(shipped, tree_widths=WIDTHS, attn_impl="xla")  # a fixed tree: longspec
    assert auto.mode == "longspec" and auto.draft is not None
    assert auto.generate(prompts, max_new_tokens=10, eos_token_ids=()).tokens == [r[:10] for r in reference]
    assert Generator(shipped, mode="longspec").draft is not None  # an explicit longspec finds it too
    assert Generator(shipped, mode="ar").mode == "ar"
