"""Adaptive speculation: each round, the candidate proposal with the most expected tokens per second.

Mode "auto" decodes with an `Adaptive` proposer: a few static candidates, each a branch of one
compiled decode loop. The policy picks on the device, and a candidate's rounds run back to back in
an inner loop until the pick changes (decode_loop.decode), so the loop branches once per switch,
not once per round, and the host never steps in:
    "ar"      the root alone: a plain target step;
    "pld N"   a prompt-lookup chain of N tokens (free to propose, strong on text that repeats its
              context);
    "tree W"  the LongSpec draft's tree of level widths W (when the target has a draft);
    "tree W+pld N"  that tree with a prompt-lookup chain of N tokens beside it (the greedy trees).
Which candidates depend on sampling and batch size (`candidate_plan`): greedy decoding affords a deep
tree (beside a shallow one, for text the draft knows less); at T > 0 the draft proposes a wide
two-level tree coupled with the target's picks (acceptance.py), or at large batches a token drawn
from its distribution; large batches get smaller trees. The choice each round is policy.py's.

State: the candidates' proposers keep their own state (`sources`: the draft's ring, PLD's history);
candidates of one draft (or the prompt-lookup chains) share it, and a tree with a lookup chain
proposes from both. The sources that proposed a round take what it kept through `accept`; every
other source sits out the run of rounds it is not part of and catches up once after it, from the
output (`catch_up`: the draft writes the tokens it did not see into its ring from their embeddings
alone, which is what it would have written itself; prompt lookup writes them into its history). A
round then carries no other source's bookkeeping, and the draft's pending tokens are at most its
own trees' depth + 1 (a lookup chain's included).

Every candidate's round is exact (greedy: AR's tokens; sampling: AR's distribution), so switching at
any round keeps the output exact; the policy only decides speed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
from flax import struct

from longspec_jax.policy import PolicyState, init_policy
from longspec_jax.proposers import (
    PLD_DEFAULT_TOKENS,
    BlockDraft,
    DraftProposer,
    DraftWithLookup,
    LookupProposal,
    NoProposal,
    PromptLookup,
    check_draft,
    check_lookup_tokens,
    draft_parameters,
)
from longspec_jax.tree import DEFAULT_WIDTHS, lookup_widths, validate_widths

LARGE_BATCH = 4  # from this many sequences on, smaller trees
DRAWN_CHAIN = (1,)  # the draft's candidate at T > 0 from LARGE_BATCH on: one token drawn from it
COUPLED_TREE = (16, 8)  # ... below LARGE_BATCH: a wide, shallow tree coupled with the target's picks
SHALLOW_TREE = (4, 4, 4)  # greedy below LARGE_BATCH, beside the deep tree: a smaller one for text the draft knows less
DEFAULT_LOOKUP_TOKENS = 32  # the lookup chain beside the greedy trees unless asked otherwise
LOOKUP_SUFFIX = "+pld "  # "tree 4,16,16,11+pld 16": the tree with a 16-token lookup chain beside it


def tree_candidate_name(widths: tuple[int, ...], lookup_tokens: int = 0) -> str:
    """A tree candidate's name: "tree 4,4,4", or with a lookup chain beside it "tree 4,4,4+pld 16"
    (`lookup_tokens_of` reads the chain back)."""
    return "tree " + ",".join(map(str, widths)) + (f"{LOOKUP_SUFFIX}{lookup_tokens}" if lookup_tokens else "")


def greedy_deep_tree(lookup_tokens: int) -> tuple[int, ...]:
    """The deep greedy tree below LARGE_BATCH: the longspec mode's tree (DEFAULT_WIDTHS) cut, level
    by level, to the nodes a chain of lookup_tokens leaves it, so that the two verify the rows that
    tree alone does (74 rows made a round's matrix products slower): (4, 16, 11) beside 32 tokens,
    (4, 16, 16, 11) beside 16, DEFAULT_WIDTHS without a chain; never less than its first level."""
    room = max(sum(DEFAULT_WIDTHS) - lookup_tokens, DEFAULT_WIDTHS[0])
    widths = []
    for width in DEFAULT_WIDTHS:
        if room == 0:
            break
        widths.append(min(width, room))
        room -= widths[-1]
    return tuple(widths)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """name: "ar", "pld N", "tree w1,w2,..." or "tree w1,w2,...+pld N" (the tree with a
    prompt-lookup chain of N tokens beside it, proposers.DraftWithLookup); sources: the indices of
    the proposers whose state it proposes from: one, or for a tree with a lookup chain the draft's
    and the prompt lookup's, which its proposer holds together as a `LookupProposal`; proposer: the
    proposer that builds its tree."""

    name: str
    sources: tuple[int, ...]
    proposer: Any

    @property
    def depth(self) -> int:
        return len(self.proposer.widths)

    def state(self, states: tuple):
        """Its proposer's state, from every source's."""
        if len(self.sources) == 1:
            return states[self.sources[0]]
        draft, history = (states[j] for j in self.sources)
        return LookupProposal(draft=draft, history=history)

    def put(self, states: tuple, state) -> tuple:
        """Every source's state once its proposer's is `state`."""
        parts = (state,) if len(self.sources) == 1 else (state.draft, state.history)
        new = dict(zip(self.sources, parts))
        return tuple(new.get(j, s) for j, s in enumerate(states))


@struct.dataclass
class AdaptiveState:
    """sources: each source proposer's state; policy: policy.py's estimates."""

    sources: tuple
    policy: PolicyState


@dataclasses.dataclass(frozen=True)
class Adaptive:
    """sources: the proposers that own state (init / skip / accept); candidates: what a round may
    run. Parameters: a tuple with each source's parameters."""

    sources: tuple
    candidates: tuple[Candidate, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.candidates)

    def waits_out(self, source: int, candidate: int) -> bool:
        """Whether source `source` sits out the rounds of candidate `candidate` and catches up after
        the run (`catch_up`): every source with state that is not the candidate's own. Kept round by
        round instead, the draft would run a projection and a ring write, and prompt lookup a history
        write, in every round of another candidate, and the draft's pending rows would have to hold
        the longest chain's tokens; a catch-up costs about one such round per run."""
        return source not in self.candidates[candidate].sources and not isinstance(self.sources[source], NoProposal)

    @property
    def widths(self) -> tuple[int, ...]:
        """The deepest candidate's widths: buffers are sized for its round."""
        return max((c.proposer.widths for c in self.candidates), key=len)

    @property
    def slack(self) -> int:
        """Cache rows past the kept tokens the largest tree writes."""
        return max(sum(c.proposer.widths) for c in self.candidates)

    def init(self, params, model, cache, prompt_tokens, prompt_lengths, first):
        sources = tuple(
            src.init(p, model, cache, prompt_tokens, prompt_lengths, first) for src, p in zip(self.sources, params)
        )
        most = [c.depth + 1 for c in self.candidates]
        # Costs and priors are set from the calibration before the first round (calibration.py).
        policy = init_policy(jnp.ones((len(self.candidates),)), max_tokens=most)
        return AdaptiveState(sources=sources, policy=policy)

    def cache_bytes(self, state: AdaptiveState) -> int:
        return sum(src.cache_bytes(s) for src, s in zip(self.sources, state.sources))


def candidate_plan(
    has_draft: bool, greedy: bool, batch: int, lookup_tokens: int | None = None
) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(name, widths) of the candidates for a request: always AR, a draft tree when there is a draft,
    and a prompt-lookup chain (but at T > 0 below LARGE_BATCH beside a tree, see below). Below
    LARGE_BATCH greedy decoding affords a deep tree and a long chain, and gets a shallow tree too
    (SHALLOW_TREE): where the draft knows the text less, its deep levels rarely keep anything, and a
    (4, 4, 4) round costs about 1.7 AR steps where the deep tree's costs 2.3-2.6. On the H200
    (SmolLM2 and its draft, T = 0, each prompt after six warm-up requests, 2026-12-04) mode auto with it
    ran at 1.65-1.87x AR on the stdlib code set where the deep tree alone ran 1.78-1.87x,
    1.53-1.66x on the docs summaries (deep tree 1.40x), 1.88-2.35x on the diverse code set (deep
    tree 1.28-1.31x) and 1.11-1.21x on the diverse summaries (deep tree 1.12-1.14x; before it,
    0.97-1.03x there).
    From LARGE_BATCH sequences on, the smallest: a one-token chain and a two-node tree. Measured on
    the H200 (SmolLM2, batch 4 and 8, T = 0): either alone ran at 1.05-1.69x AR (a one-token
    chain's round costs what an AR step does, the tree's 1.1-1.2 AR steps, and each keeps 1.5-1.9
    tokens), ahead of an adaptive set that also held a 10-token chain and a (4, 8, 8) tree
    (0.84-1.49x), whose mixed runs cost up to a third more than their candidates' calibrated rounds.
    At T > 0 below LARGE_BATCH the draft's candidate is a tree coupled with the target's picks
    (acceptance.py), wide near the root and two levels deep: the target's distribution is wide, so
    more candidates near the root buy kept tokens more cheaply than a third level does, which also
    costs a draft step a round. On the H200 at T = 1 (SmolLM2 and its draft, 8
    prompts a task, 2026-12-04, BENCHMARKS.md) a (16, 8) round cost 0.98-0.99 of a (4, 4, 4) round
    and kept as much on code and 4-8 % more on summaries: 1.24-1.27x AR against 1.22-1.25x on code,
    1.25-1.30x against 1.15-1.21x on summaries, on the stdlib/docs and the diverse sets; deeper
    trees ((4, 8, 8, 8), (6, 6, 6)) kept more and cost more (1.15-1.26x), a (16, 16) likewise
    (1.20-1.29x). A token drawn from the draft (verified by speculative sampling) keeps 1.45 a
    round for ~1.25 AR steps: below the (4, 4, 4) tree that was the coupled one then on
    both tasks, and next to AR where the draft is poor. Offered beside the tree it cost more than
    it brought: a few unlucky first rounds of the tree left the policy on the drawn token, whose
    estimate firms up faster (it runs every round), and mode auto ran at 0.96x / 1.05x AR where that
    tree alone ran 1.22x / 1.13x (2026-12-03). At batch 4 and 8 a coupled (2, 2) tree beside the
    drawn token made auto slower (0.94-1.09x against 1.09-1.25x with the drawn token alone), so
    large batches keep the drawn token only. The prompt-lookup chain is short, and at T > 0 below
    LARGE_BATCH it is left out beside the coupled tree: there it kept 1.0-1.55 tokens a round for
    1.25 AR steps (AR's rate), and its trials took 6-32 of a request's 64 rounds from the tree
    (mode auto 1.07x AR on code at T = 1 with it, 1.12x without, the same tree; H200, 2026-12-03).
    Each candidate is one more branch to compile, so few.
    Greedy below LARGE_BATCH both trees carry a prompt-lookup chain beside them
    (`proposers.DraftWithLookup`) of lookup_tokens tokens (None: DEFAULT_LOOKUP_TOKENS; 0: none): a
    round keeps the longer of what the draft's branches and the chain agree with, so it keeps at
    least what the tree alone does. With a chain the deep tree is the longspec mode's cut to the rows
    the chain leaves it (`greedy_deep_tree`): a 32-token chain beside (4, 16, 11) verifies 64 rows, as
    the longspec mode's tree alone does, where a 10-token one beside the longspec mode's tree made 74
    and cost more (SmolLM2's round 1.65 -> 1.80 ms, its matrix products 0.61 -> 0.69 ms; Vicuna-7B's
    at 4k 7.23 -> 7.70 ms). Since the chain goes on as an overlapping copy (`pld`), 32 tokens beside
    (4, 16, 11) keep more than 16 beside (4, 16, 16, 11) with a draft step fewer (CPU tau, the same
    prompts, BENCHMARKS.md, 2026-12-05: stdlib code 9.13 -> 11.78, docs summaries 5.84 -> 6.54,
    diverse summaries 3.84 -> 3.86; not yet timed on a GPU). Before that, on the H200 (SmolLM2 and
    its draft, T = 0, 8 prompts a task, 128 tokens, BENCHMARKS.md, 2026-12-05), fixed, (4, 16, 16, 11)
    with 16 tokens ran at 2.42x / 2.15x AR on the stdlib code / docs summaries and 2.92x / 1.71x on
    the diverse sets, the deep tree with 10 tokens at 2.36x / 1.89x / 2.47x / 1.56x, the deep tree
    alone at 1.93x / 1.46x / 1.35x / 1.19x; mode auto with 16-token chains beside (4, 16, 16, 11) and
    (4, 4, 4) at 2.33x / 2.17x / 2.92x / 1.72x (with 10-token chains 2.05x / 1.95x / 2.72x / 1.58x, same
    process). The chain alone stays PLD_DEFAULT_TOKENS long: with 16, mode auto's tokens per ms of
    round went up on two of the four sets and down on the other two."""
    lookup_tokens = DEFAULT_LOOKUP_TOKENS if lookup_tokens is None else lookup_tokens
    with_chain = lookup_tokens if greedy and batch < LARGE_BATCH else 0
    if greedy:
        chains, trees = (
            ((1,), [(2,)])
            if batch >= LARGE_BATCH
            else ((PLD_DEFAULT_TOKENS,), [greedy_deep_tree(with_chain), SHALLOW_TREE])
        )
    else:
        chains, trees = ((1,), [DRAWN_CHAIN]) if batch >= LARGE_BATCH else (() if has_draft else (2,), [COUPLED_TREE])
    plan = [("ar", ())] + [(f"pld {n}", (1,) * n) for n in chains]
    if has_draft:
        plan += [(tree_candidate_name(w, with_chain), w) for w in trees]
    return tuple(plan)


def lookup_tokens_of(name: str) -> int:
    """The lookup chain a tree candidate's name gives it ("tree 4,4+pld 10": 10; none: 0)."""
    _, found, count = name.partition(LOOKUP_SUFFIX)
    return int(count) if found else 0


def adaptive_proposer(target, draft, plan, small_rows=None) -> tuple[Adaptive, tuple]:
    """(the static Adaptive proposer, its parameters) for a `candidate_plan` (small_rows as
    `proposers.draft_parameters`)."""
    vocab = target.config.vocab_size
    trees = [(name, validate_widths(w, vocab)) for name, w in plan if name.startswith("tree")]
    sources: list = [NoProposal()]
    params: list = [()]
    candidates = [Candidate("ar", (0,), sources[0])]
    chains = [(name, w) for name, w in plan if name.startswith("pld")]
    lookup = None
    if chains:
        sources.append(PromptLookup(max((w for _, w in chains), key=len)))  # its history serves every chain
        params.append(())
        lookup = len(sources) - 1
        candidates += [Candidate(name, (lookup,), PromptLookup(w)) for name, w in chains]
    if trees:
        check_draft(draft, target.config)
        graphdef, draft_params = draft_parameters(draft, target, small_rows, [max(w) for _, w in trees])
        slots = max(1, max(sum(w[:-1]) for _, w in trees))
        block = BlockDraft(graphdef, tree_slots=slots, window=draft.config.window)
        for name, w in trees:
            if lookup_tokens_of(name) and lookup is None:
                raise ValueError(f"candidate {name!r} needs a prompt-lookup chain in the plan for its history")
            check_lookup_tokens("longspec", w, lookup_tokens_of(name))
        # The most its own rounds keep (others' it catches up on), a lookup chain's included.
        rows = max(len(lookup_widths(w, lookup_tokens_of(name))) for name, w in trees) + 1
        sources.append(DraftProposer(block, trees[0][1], pending_rows=rows))
        params.append(draft_params)
        index = len(sources) - 1
        for name, w in trees:
            tree = DraftProposer(block, w, rows)
            if lookup_tokens_of(name):
                proposer = DraftWithLookup(tree, PromptLookup((1,) * lookup_tokens_of(name)))
                candidates.append(Candidate(name, (index, lookup), proposer))
            else:
                candidates.append(Candidate(name, (index,), tree))
    return Adaptive(tuple(sources), tuple(candidates)), tuple(params)
