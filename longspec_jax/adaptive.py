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
tree with a long prompt-lookup chain beside it; at T > 0 the draft proposes a wide
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
# Greedy below LARGE_BATCH without a lookup chain, beside the deep tree: for text the draft knows less.
SHALLOW_TREE = (4, 4, 4)
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
    """(name, widths) of the candidates for a request: always AR (the fallback that keeps mode auto
    from running slower than plain decoding), then what suits the sampling and the batch. Each
    candidate is one more branch to compile, so few. All figures: SmolLM2-135M and its shipped
    draft, 8 prompts a task, BENCHMARKS.md.

    Greedy below LARGE_BATCH with a draft: the deep tree with a prompt-lookup chain of lookup_tokens
    tokens beside it (None: DEFAULT_LOOKUP_TOKENS), and nothing else. A round keeps the longer of
    what the draft's branches and the chain agree with (`proposers.DraftWithLookup`), so it keeps at
    least what the chain alone would, and the tree is the longspec mode's cut to the rows the chain
    leaves it (`greedy_deep_tree`: (4, 16, 11) beside 32 tokens). On an H100 (2026-12-05, T = 0) that tree fixed
    ran at 3.97x / 2.32x AR on the stdlib code / docs summaries and 3.60x / 1.81x on the diverse
    sets, where mode auto that also held the 10-token chain alone and a (4, 4, 4) tree with the same
    chain ran at 3.10x / 2.03x / 3.54x / 1.75x: the chain alone's rounds cost 0.65 of the tree's and
    won the policy on stretches where it kept some tokens, though the tree with the chain keeps more
    in the same round, and with the chain the (4, 4, 4) round cost as much as the deep tree's.
    Without a chain (lookup_tokens 0), the longspec mode's tree, a shallow one (SHALLOW_TREE, for text
    the draft knows less) and the 10-token chain alone.

    Sampling below LARGE_BATCH with a draft: a wide, two-level tree coupled with the target's picks
    (COUPLED_TREE, acceptance.py); the target's distribution is wide, so candidates near the root
    buy kept tokens more cheaply than a third level. On the H200 at T = 1 (2026-12-04) a (16, 8)
    round cost what a (4, 4, 4) one did and kept as much on code and 4-8 % more on summaries;
    deeper trees kept more and cost more. A token drawn from the draft offered beside it, or a
    prompt-lookup chain, took rounds from the tree on a few unlucky starts and made mode auto slower
    (0.96-1.07x AR against 1.12-1.22x without them, 2026-12-03).

    From LARGE_BATCH sequences on, the smallest: greedy a one-token chain and a two-node tree,
    sampling a one-token chain and a token drawn from the draft. Measured on the H200 (batch 4 and
    8, T = 0): either alone ran at 1.05-1.69x AR, ahead of larger sets (0.84-1.49x). Without a draft:
    AR and a prompt-lookup chain (10 tokens greedy, 2 sampling)."""
    lookup_tokens = DEFAULT_LOOKUP_TOKENS if lookup_tokens is None else lookup_tokens
    with_chain = lookup_tokens if greedy and batch < LARGE_BATCH else 0
    if batch >= LARGE_BATCH:
        chains, trees = ((1,), [(2,)] if greedy else [DRAWN_CHAIN])
    elif not greedy:
        chains, trees = (() if has_draft else (2,), [COUPLED_TREE])
    elif has_draft and with_chain:
        chains, trees = ((), [greedy_deep_tree(with_chain)])
    else:
        chains, trees = ((PLD_DEFAULT_TOKENS,), [DEFAULT_WIDTHS, SHALLOW_TREE])
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
    if chains or any(lookup_tokens_of(name) for name, _ in trees):
        sources.append(PromptLookup())  # one history serves every chain, alone or beside a tree
        params.append(())
        lookup = len(sources) - 1
        candidates += [Candidate(name, (lookup,), PromptLookup(w)) for name, w in chains]
    if trees:
        check_draft(draft, target.config)
        graphdef, draft_params = draft_parameters(draft, target, small_rows, [max(w) for _, w in trees])
        slots = max(1, max(sum(w[:-1]) for _, w in trees))
        block = BlockDraft(graphdef, tree_slots=slots, window=draft.config.window)
        for name, w in trees:
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
