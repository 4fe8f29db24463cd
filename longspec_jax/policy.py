"""The adaptive speculation policy: each round, the candidate with the most expected tokens per second.

The engine holds a few static candidates (each its own compiled branch of the round): "ar" (a plain
target step, the proposer that proposes nothing) and one or more draft trees (or a prompt-lookup
chain). Before decoding it knows what one round of each candidate costs on this device
(`Calibration`, measured once and kept on disk, see calibration.py). Inside the device loop it
keeps, per candidate, a running estimate of the tokens a round emits (the mean of the prior and
its first rounds, then an exponential moving average, so the first evidence counts fully and a
later change of text is followed; when sampling, an estimate remembered from earlier requests counts
as the rounds behind it), and picks

    argmax_k  tokens_per_round[k] / seconds_per_round[k]

When sampling, a round's tokens are mostly luck (a drawn token is kept or not) while their
mean moves little with the text, so the average reaches further back (SAMPLED_EMA_WEIGHT), and each
estimate is judged by an upper confidence bound, SAMPLED_BONUS / sqrt(rounds) above it: a drawn
token that keeps 1.5 tokens a round where 1.36 break even (T = 1 on the H200) would otherwise drop
below break-even after a few unlucky rounds and wait out its retries on AR (`tests/test_policy.py`);
one that never keeps a token is dropped after six rounds.
AR emits exactly one token per round, so its estimate is fixed at 1. A candidate that is not picked
gathers no evidence, so a losing candidate is retried after `wait[k]` rounds times what its round
costs against the best's (a retry costs that much, so an expensive candidate is retried as much
less often; at most MAX_WAIT rounds). Every candidate starts due, so each one that could win is
tried in the first rounds whatever its prior: a tree whose prior rate is
below AR's would otherwise wait its first retry out on AR even where it keeps six tokens a round.
Every retry that does not make it the best doubles its wait,
so a draft that never pays costs at most a round in MAX_WAIT (MIN_SAMPLED_RUN rounds when sampling),
and one that starts paying again is found within that many rounds. When sampling, a candidate other
than AR, once picked, runs MIN_SAMPLED_RUN rounds before it is judged again: judged after every
round, a trial ended at its first unlucky round, so a tree that keeps 2.4 tokens a round where 1.7
break even, retried one round at a time, could lose every retry and leave a request to AR (seen at
T = 1 on the H200: 126 AR-bound rounds where the tree alone took 52). Greedy, the same holds for a
different reason: what a greedy round keeps is skewed (on prose most rounds of the (4, 16, 11) tree
with its chain keep 1-4 tokens, a few keep 10-30), so one round says little about the mean. A greedy
run of a candidate other than AR therefore lasts until it has cost about GREEDY_TRIAL_AR_STEPS AR
steps (four rounds of a tree that costs two AR steps on a GPU; one round where a round costs ten or
more, as on a CPU), and a retry (a run after a wait of FIRST_WAIT rounds or more: the text has moved
on) weighs its old estimate as one round only, so the trial decides. Judged one round at a time, with
the old estimate's full weight, mode auto ran 16-98 AR rounds of 128-token summaries where the tree
kept 2.8-7.6 tokens a round (H100, 2026-12-05), and lost 7-10 % to the fixed tree; with trials it
still ran 18-50 such AR rounds and lost 6 %. So greedy, once past its trial a running tree also stays
until its estimate is GREEDY_STAY_MARGIN below break-even (`judged_rates`). A trial whose
first HOPELESS_AFTER rounds (GREEDY_HOPELESS_AFTER greedy) kept nothing the target did not pick
itself (one token a round) ends there: a draft that is never right costs three rounds a retry (greedy
two), not eight (greedy four). All of it is
arrays in the loop's carry, updated by every round and read by `choose` on the device: the host
takes no part in the choice (decode_loop.decode).

Exactness does not depend on the policy: every candidate's round emits tokens distributed exactly as
the target's (greedy: equal to AR), so switching between them at any round keeps the output exact.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

EMA_WEIGHT = 0.125  # weight of the newest round in a candidate's estimate (tau per round is noisy)
SAMPLED_EMA_WEIGHT = 1 / 64  # ... when sampling (what a round keeps is luck; what it keeps on average moves slowly)
SAMPLED_BONUS = 0.75  # when sampling, tokens added to an estimate of n rounds, over sqrt(n): 1.5 rounds' spread
FIRST_WAIT = 8  # rounds before a losing candidate is first retried
MAX_WAIT = 256  # ... and at most this many after repeated losses
MIN_SAMPLED_RUN = 8  # when sampling, rounds a picked candidate other than AR runs before it is judged again
GREEDY_TRIAL_AR_STEPS = 8.0  # greedy, a run of one other than AR lasts this many AR steps' worth (>= 1 round)
HOPELESS_AFTER = 3  # ... unless its first this many rounds kept no token beyond the target's own
GREEDY_HOPELESS_AFTER = 2  # ... greedy
GREEDY_STAY_MARGIN = 0.25  # greedy, the running candidate (not AR) is judged as if its rate were 1 / (1 - this) higher
AR = 0  # candidate 0 is always the plain target step


@struct.dataclass
class PolicyState:
    """Per-candidate arrays float32/int32[K] (K static): seconds_per_round from the calibration;
    tokens_per_round the running estimate (AR's stays 1); evidence the rounds it rests on (the
    prior counts as one, a remembered estimate as the rounds behind it); since_used rounds since it last ran;
    wait the rounds a non-best candidate waits before its next retry; rounds / emitted the
    rounds each ran and the tokens they kept (summed over the batch), and candidate_runs
    (int32[]) the runs of one candidate's rounds the loop made (decode_loop.decode), for the stats;
    last (int32[]) the candidate of the latest round (-1 before any), streak (int32[]) the rounds
    it has run in a row and run_kept (float32[]) the tokens a sequence kept in them (0 for AR)."""

    seconds_per_round: jax.Array
    tokens_per_round: jax.Array
    evidence: jax.Array
    max_tokens: jax.Array
    since_used: jax.Array
    wait: jax.Array
    rounds: jax.Array
    emitted: jax.Array
    active: jax.Array
    candidate_runs: jax.Array
    last: jax.Array
    streak: jax.Array
    run_kept: jax.Array


def init_policy(seconds_per_round, prior_tokens_per_round=None, max_tokens=None) -> PolicyState:
    """seconds_per_round / prior_tokens_per_round / max_tokens: float[K] (entry 0 is AR: its prior
    is forced to 1). The prior counts as one round of evidence; by default it is each candidate's
    break-even (`break_even_tokens`), so the first trials, not a guess, decide. max_tokens: the most
    a round can keep (tree depth + 1; default: no bound)."""
    cost = jnp.asarray(seconds_per_round, jnp.float32)
    prior = break_even_tokens(cost) if prior_tokens_per_round is None else jnp.asarray(prior_tokens_per_round)
    prior = prior.astype(jnp.float32).at[AR].set(1.0)
    k = cost.shape[0]
    zeros = jnp.zeros((k,), jnp.int32)
    most = jnp.full((k,), jnp.inf, jnp.float32) if max_tokens is None else jnp.asarray(max_tokens, jnp.float32)
    return PolicyState(
        seconds_per_round=cost,
        tokens_per_round=prior,
        evidence=jnp.ones((k,), jnp.float32),
        max_tokens=most,
        since_used=jnp.full((k,), MAX_WAIT, jnp.int32),  # all due: each is tried once at the start
        wait=jnp.full((k,), FIRST_WAIT, jnp.int32),
        rounds=zeros,
        emitted=zeros,
        active=zeros,
        candidate_runs=jnp.zeros((), jnp.int32),
        last=jnp.full((), -1, jnp.int32),
        streak=jnp.zeros((), jnp.int32),
        run_kept=jnp.zeros((), jnp.float32),
    )


def break_even_tokens(seconds_per_round: jax.Array) -> jax.Array:
    """float32[K]: the tokens a round of each candidate must keep to match AR's rate."""
    return seconds_per_round / seconds_per_round[AR]


def with_costs(policy: PolicyState, seconds_per_round) -> PolicyState:
    """The policy with its seconds per round replaced (the calibration's); a candidate that has not
    run yet starts from its new break-even: a neutral prior, so its first trial decides. (A prior
    above it, optimistic, kept a chain that keeps one token a round at T = 1 running while the
    prior wore off; one below it, like the 3 tokens once given the deep tree that must keep 3.3 to
    pay on the H200, hid a tree that keeps six.)"""
    cost = jnp.asarray(seconds_per_round, jnp.float32)
    untried = policy.rounds == 0
    tokens = jnp.where(untried, break_even_tokens(cost), policy.tokens_per_round).at[AR].set(1.0)
    evidence = jnp.where(untried, 1.0, policy.evidence)
    return policy.replace(seconds_per_round=cost, tokens_per_round=tokens, evidence=evidence)


def with_memory(policy: PolicyState, tokens_per_round, wait, rounds) -> PolicyState:
    """The policy with what earlier requests of this kind kept (acceptance_memory.py):
    tokens_per_round float[K] (NaN where nothing is remembered), wait int[K], rounds float[K] the
    rounds the remembered estimate rests on. A candidate other than AR that has not run yet and is
    remembered starts from its remembered estimate, weighed as that many rounds (so one unlucky
    round does not overturn what dozens showed), and its retry wait, and is not due for a first
    trial: it runs at once if that makes it the best, else when its wait is out."""
    tokens = jnp.asarray(tokens_per_round, jnp.float32)
    k = policy.since_used.shape[0]
    known = jnp.isfinite(tokens) & (policy.rounds == 0) & (jnp.arange(k) != AR)
    return policy.replace(
        tokens_per_round=jnp.where(known, tokens, policy.tokens_per_round),
        evidence=jnp.where(known, jnp.maximum(jnp.asarray(rounds, jnp.float32), 1.0), policy.evidence),
        since_used=jnp.where(known, 0, policy.since_used),
        wait=jnp.where(known, jnp.clip(jnp.asarray(wait, jnp.int32), FIRST_WAIT, MAX_WAIT), policy.wait),
    )


def with_costs_and_memory(policy: PolicyState, seconds_per_round, tokens_per_round, wait, rounds) -> PolicyState:
    """A request's starting policy: `with_costs`, then `with_memory` (NaN tokens: nothing remembered)."""
    return with_memory(with_costs(policy, seconds_per_round), tokens_per_round, wait, rounds)


def first_max(values):
    """The index of the first largest of values [K] (jnp.argmax's answer, NaN aside), unrolled over
    the few static candidates: compares and selects that XLA fuses with the rest of the policy's
    per-round arithmetic, where a reduction would cost a kernel of its own each round."""
    best, index = values[0], jnp.int32(0)
    for k in range(1, values.shape[0]):
        better = values[k] > best
        best, index = jnp.where(better, values[k], best), jnp.where(better, jnp.int32(k), index)
    return index


def expected_rates(policy: PolicyState, sampled=False) -> jax.Array:
    """float32[K]: estimated tokens per second of each candidate. sampled (bool, may be traced): the
    request samples, and each estimate other than AR's counts SAMPLED_BONUS / sqrt(its rounds)
    tokens more (an upper confidence bound): a drawn token is kept or not at random, so a few
    rounds say little, and a candidate that paid was otherwise dropped after a few unlucky first
    rounds and, retried one round at a time, rarely won its place back (mode auto then ran AR for
    whole requests at T = 1, and remembered that for the next ones). The bonus fades as the rounds
    add up; one that does not pay keeps it only while its margin is within it."""
    k = policy.tokens_per_round.shape[0]
    bonus = SAMPLED_BONUS / jnp.sqrt(jnp.maximum(policy.evidence, 1.0))
    bonus = jnp.where(sampled & (jnp.arange(k) != AR), bonus, 0.0)
    return (policy.tokens_per_round + bonus) / policy.seconds_per_round


def judged_rates(policy: PolicyState, sampled=False) -> jax.Array:
    """float32[K]: the rates `choose` compares: `expected_rates`, and greedy, the running candidate's
    (the latest round's, other than AR) as if it were 1 / (1 - GREEDY_STAY_MARGIN) higher, so that it
    keeps its place until its estimate falls that far below what would make it the best. A greedy
    round's keep is skewed (most rounds of a summary keep 1-4 tokens, a few 10-32), so an estimate a
    little under break-even after a run of short rounds says little, while leaving sends the request
    to AR until the next retry. A hopeless trial (`_hopeless`) gets no margin. Replayed at the H100's
    costs (2026-12-05), mode auto on the diverse summaries went from 0.93 of the fixed tree's speed
    to 1.00, and on text the draft never gets right stayed at 0.97 of AR's."""
    rates = expected_rates(policy, sampled)
    k = rates.shape[0]
    running = (
        (jnp.arange(k) == policy.last) & (policy.last != AR) & jnp.logical_not(sampled) & ~_hopeless(policy, sampled)
    )
    return jnp.where(running, rates / (1.0 - GREEDY_STAY_MARGIN), rates)


def _hopeless(policy: PolicyState, sampled) -> jax.Array:
    """bool[]: the running candidate's first HOPELESS_AFTER rounds (GREEDY_HOPELESS_AFTER greedy)
    kept one token each: its trial ends, and greedy, it has no margin to stay on."""
    hopeless_after = jnp.where(sampled, HOPELESS_AFTER, GREEDY_HOPELESS_AFTER)
    return (policy.streak >= hopeless_after) & (policy.run_kept <= policy.streak)


def _rounds_overdue(policy: PolicyState, best):
    """float[K]: rounds since each candidate last ran, less its retry wait (its `wait` scaled by what
    its round costs against the best's, at most MAX_WAIT); >= 0 when a retry is due."""
    relative_cost = jnp.maximum(policy.seconds_per_round / policy.seconds_per_round[best], 1.0)
    return policy.since_used - jnp.minimum(policy.wait * relative_cost, MAX_WAIT)


def choose(policy: PolicyState, sampled=False):
    """The candidate for the next round: the best by `judged_rates`, unless another one has waited
    its turn for a retry (the one that waited longest past its wait). A candidate that could not
    beat the best even if every round kept all it can (max_tokens) is never retried: on a CPU a
    74-node tree round costs twenty AR steps and can keep six tokens. sampled: as in `expected_rates`;
    then a candidate other than AR that ran fewer than MIN_SAMPLED_RUN rounds in a row runs on, and
    greedy, fewer than `trial_rounds`; either unless its first HOPELESS_AFTER rounds (greedy
    GREEDY_HOPELESS_AFTER) kept one token each."""
    rates = judged_rates(policy, sampled)
    best = first_max(rates)
    could_win = policy.max_tokens / policy.seconds_per_round > rates[best]
    overdue = _rounds_overdue(policy, best)
    candidates = jnp.arange(policy.since_used.shape[0])
    overdue = jnp.where((candidates != best) & (candidates != AR) & could_win, overdue, -1)
    retry = first_max(overdue)
    pick = jnp.where(overdue[retry] >= 0, retry, best)
    hopeless = _hopeless(policy, sampled)
    running = jnp.maximum(policy.last, AR)
    run_length = jnp.where(sampled, MIN_SAMPLED_RUN, trial_rounds(policy)[running])
    on_trial = (policy.last > AR) & (policy.streak < run_length) & ~hopeless
    return jnp.where(on_trial, policy.last, pick).astype(jnp.int32)


def trial_rounds(policy: PolicyState) -> jax.Array:
    """float32[K]: the rounds a greedy run of each candidate lasts before it is judged: as many as
    cost GREEDY_TRIAL_AR_STEPS AR steps, at least one."""
    return jnp.maximum(jnp.floor(GREEDY_TRIAL_AR_STEPS / break_even_tokens(policy.seconds_per_round)), 1.0)


def ar_rounds_before_a_retry(policy: PolicyState, sampled=False) -> jax.Array:
    """int32[]: how many AR rounds in a row `choose` picks from here, given that it picks AR now.
    AR rounds change no estimate (AR's is fixed at 1), so the best stays AR and only the retry
    clocks advance: the pick changes when the first candidate's retry falls due. The loop runs
    that many AR rounds without consulting the policy each round (decode_loop.decode) and
    records them at once (`record_ar_rounds`); the picks are the same as round by round."""
    rates = expected_rates(policy, sampled)
    best = first_max(rates)
    could_win = policy.max_tokens / policy.seconds_per_round > rates[best]
    candidates = jnp.arange(policy.since_used.shape[0])
    eligible = (candidates != best) & (candidates != AR) & could_win
    # A retry of k is due once since_used[k] reaches its threshold (_rounds_overdue >= 0).
    due_in = jnp.ceil(-_rounds_overdue(policy, best)).astype(jnp.int32)
    never = jnp.iinfo(jnp.int32).max // 2
    return jnp.maximum(jnp.min(jnp.where(eligible, due_in, never)), 1)


def record_ar_rounds(
    policy: PolicyState, rounds: jax.Array, kept: jax.Array, active: jax.Array, sampled=False
) -> PolicyState:
    """`record` of `rounds` (int32[]) AR rounds in a row that kept `kept` tokens while `active`
    sequences ran, in all (int32[] each): the same state as recording them one by one (AR's
    estimate is fixed, so only the clocks and counters move)."""
    policy = _advance_clocks(policy, jnp.int32(AR), rounds, sampled).replace(run_kept=jnp.zeros((), jnp.float32))
    return count_rounds(policy, jnp.int32(AR), rounds, kept, active)


def count_rounds(policy: PolicyState, chosen, rounds, kept, active) -> PolicyState:
    """The stats counters after `rounds` rounds of candidate `chosen` that kept `kept` tokens while
    `active` sequences ran, in all. `choose` does not read them, so the loop counts a run's rounds
    once at its end (decode_loop.decode) rather than in every round (`record(..., counted=False)`)."""
    is_chosen = jnp.arange(policy.rounds.shape[0]) == chosen
    return policy.replace(
        rounds=policy.rounds + jnp.where(is_chosen, rounds, 0).astype(jnp.int32),
        emitted=policy.emitted + jnp.where(is_chosen, kept, 0).astype(jnp.int32),
        active=policy.active + jnp.where(is_chosen, active, 0).astype(jnp.int32),
    )


def _advance_clocks(policy: PolicyState, chosen, rounds, sampled) -> PolicyState:
    """`rounds` rounds of candidate `chosen` with its estimate already updated: retry waits, rounds
    since each candidate ran, and the current run. A run of a candidate that is not the best after
    its first round (a retry that lost) doubles its wait once; the best's wait resets."""
    k = policy.since_used.shape[0]
    is_chosen = jnp.arange(k) == chosen
    ran = rounds > 0
    best = first_max(expected_rates(policy, sampled))
    new_run = policy.last != chosen
    doubled = jnp.minimum(policy.wait * 2, MAX_WAIT)
    wait = jnp.where(is_chosen & (chosen != best) & ran & new_run, doubled, policy.wait)
    wait = jnp.where((jnp.arange(k) == best) & ran, FIRST_WAIT, wait)
    return policy.replace(
        since_used=jnp.where(is_chosen, jnp.where(ran, 0, policy.since_used), policy.since_used + rounds),
        wait=wait,
        last=jnp.where(ran, chosen, policy.last).astype(jnp.int32),
        streak=jnp.where(ran, jnp.where(new_run, 0, policy.streak) + rounds, policy.streak).astype(jnp.int32),
    )


def batch_progress(n_new: jax.Array, n_keep: jax.Array, running: jax.Array) -> jax.Array:
    """float32[]: what a round is worth to the batch: the mean tokens kept by the running sequences
    furthest behind (n_new int32[B] before the round, n_keep int32[B] what each kept, running
    bool[B] not done before it). A batch is done only when its last sequence is, so a candidate
    that gives three sequences five tokens a round and the fourth one brings the end one token
    nearer a round: that fourth sequence falls behind and from then on is what the round is
    judged by. Where acceptance is luck alike for every sequence, which one is behind says nothing
    about what it keeps next, so this is the mean a sequence keeps: unbiased even when every
    sequence holds as many tokens as the others (at the start, after AR rounds), where the rise of
    the fewest tokens any holds would be the fewest kept (about 1 a round at batch 8 for any
    candidate). Never below the fewest kept; 0 when no sequence runs."""
    big = jnp.iinfo(jnp.int32).max
    behind = running & (n_new == jnp.min(jnp.where(running, n_new, big)))
    count = jnp.sum(behind)
    return (jnp.sum(jnp.where(behind, n_keep, 0)) / jnp.maximum(count, 1)).astype(jnp.float32)


def record(
    policy: PolicyState,
    chosen: jax.Array,
    kept: jax.Array,
    active: jax.Array,
    progress=None,
    sampled=False,
    counted: bool = True,
) -> PolicyState:
    """After a round of candidate `chosen` in which `active` sequences (int32[]) kept `kept` tokens
    in total (int32[]): update its estimate, the retry clocks and (counted) the stats counters.
    progress (float32[], optional): what the round is worth to the batch (`batch_progress`); when
    given, the estimate follows it instead of the mean tokens a sequence kept. sampled (bool, may be
    traced): the request samples, so the estimate settles more slowly (SAMPLED_EMA_WEIGHT)."""
    k = policy.since_used.shape[0]
    is_chosen = jnp.arange(k) == chosen
    per_sequence = kept.astype(jnp.float32) / jnp.maximum(active, 1).astype(jnp.float32)
    if progress is not None:
        per_sequence = progress.astype(jnp.float32)
    ran = is_chosen & (active > 0) & (chosen != AR)
    # Greedy, a run after a wait (the text moved on) weighs the old estimate as one round: the trial decides.
    restart = is_chosen & jnp.logical_not(sampled) & (policy.since_used >= FIRST_WAIT)
    evidence = jnp.where(restart, jnp.minimum(policy.evidence, 1.0), policy.evidence)
    # A running mean over the evidence (the prior one round) until a round weighs the EMA weight.
    weight = jnp.maximum(1.0 / (evidence + 1.0), jnp.where(sampled, SAMPLED_EMA_WEIGHT, EMA_WEIGHT))
    estimate = jnp.where(ran, (1.0 - weight) * policy.tokens_per_round + weight * per_sequence, policy.tokens_per_round)
    # The evidence is overwritten once the estimate has read it: in place, not after a copy.
    estimate, evidence = jax.lax.optimization_barrier((estimate, evidence))
    run_kept = jnp.where(policy.last == chosen, policy.run_kept, 0.0) + per_sequence
    policy = policy.replace(
        tokens_per_round=estimate,
        evidence=evidence + ran.astype(jnp.float32),
        run_kept=jnp.where(chosen == AR, 0.0, run_kept).astype(jnp.float32),
    )
    policy = _advance_clocks(policy, chosen, jnp.int32(1), sampled)
    return count_rounds(policy, chosen, jnp.int32(1), kept, active) if counted else policy
