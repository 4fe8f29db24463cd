"""Proposers: what puts a tree of candidate tokens in front of the target each round.

A round (decode_loop.py) asks its proposer for a tree rooted at the last emitted token (the root,
not in the target cache yet), verifies it with one target forward, accepts a path and tells the
proposer which tokens were kept. A proposer is a frozen, hashable dataclass (part of the loop's
static config); its parameters travel apart as a jit argument, its state rides in the loop state:

    widths                                   the tree's level widths, static; () = the root alone
    init(params, model, cache, prompt_tokens, prompt_lengths, first) -> state
    propose(params, model, state, roots, cache, attn_impl, sampling, key) -> (tree.Tree, state)
        sampling: the request's SamplingParams; key: this round's, for a proposer that draws at
        random (a draft chain)
    accept(state, tokens, n_tokens, positions) -> state
        tokens int32[B, D+1] kept this round (the first n_tokens[b] valid), positions int32[B]
        the position of tokens[:, 0]; the last kept token is the next root.
    catch_up(params, model, state, out, n_out, root_pos) -> state     (stateful proposers)
        after rounds another proposer ran (adaptive.py): the state accept would have left,
        from the generated tokens out int32[B, N] (the first n_out[b] valid, the last the root
        at position root_pos[b]).
    cache_bytes(state) -> int                bytes of a draft model's cache (0 without one)

- `NoProposal` (mode "ar"): the root alone, so a round is one AR step.
- `PromptLookup` (mode "pld"): the chain that followed the last n-gram's latest earlier
  occurrence (pld.py) in its own copy of prompt + output.
- `DraftProposer` (mode "longspec"): the LongSpec draft. It feeds the tokens kept last round to the
  draft (`commit`, which also gives the root's distribution), then grows the tree level by level
  (`propose_level`, tree.py's beam; when sampling, the beam over the draft's race under the noise
  the target's picks will use, `draft.candidates_from_logits`). The draft owns its ring buffer and
  tree slots (draft.py). A chain (every width 1) is drawn instead: each token at random from the draft's
  distribution under the request's sampling settings (its argmax when greedy), verified by
  speculative sampling (acceptance.accept_drawn_chain), which at T > 0 keeps more than the draft's
  likeliest token would.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct

from longspec_jax.decode_kit import cache_bytes
from longspec_jax.draft import (
    draft_candidates,
    draft_commit,
    draft_logits,
    draft_prefill,
    draft_propose_level,
    draft_remember,
    init_draft_state,
)
from longspec_jax.draft_head import DraftHead
from longspec_jax.errors import UserError
from longspec_jax.model import small_rows_for
from longspec_jax.pld import propose_chain
from longspec_jax.sampling import filtered_logits, gumbel_noise
from longspec_jax.tree import (
    DEFAULT_WIDTHS,
    MAX_TREE_NODES,
    chain_tree,
    expand_level_from_top,
    init_tree_from_top,
    level_block,
    lookup_widths,
    num_nodes,
    root_tree,
    validate_widths,
    with_lookup_chain,
)

PLD_DEFAULT_TOKENS = 10  # candidates per PLD round (HF's prompt_lookup_num_tokens default)
PLD_MAX_NGRAM, PLD_MIN_NGRAM = 6, 1


def write_rows(buffer: jax.Array, values: jax.Array, start: jax.Array) -> jax.Array:
    """buffer [B, S] with values [B, T] written at columns [start[b], start[b] + T)."""
    if buffer.shape[0] == 1:  # one sequence: a plain slice update (the vmapped form is a scatter)
        return jax.lax.dynamic_update_slice(buffer, values.astype(buffer.dtype), (0, start[0]))
    return jax.vmap(lambda row, v, s: jax.lax.dynamic_update_slice(row, v.astype(row.dtype), (s,)))(
        buffer, values, start
    )


@dataclasses.dataclass(frozen=True)
class NoProposal:
    """AR: the tree of the root alone; verifying it is one decode step."""

    widths: tuple[int, ...] = ()

    def init(self, params, model, cache, prompt_tokens, prompt_lengths, first):
        return ()

    def propose(self, params, model, state, roots, cache, attn_impl, sampling, key):
        return root_tree(roots), state

    def accept(self, state, tokens, n_tokens, positions):
        return state

    def cache_bytes(self, state) -> int:
        return 0


@dataclasses.dataclass(frozen=True)
class PromptLookup:
    """PLD over its own history int32[B, cache rows]: prompt then output, a token's index its
    position (as long as the cache, so the loop's shapes depend on the cache bucket alone)."""

    widths: tuple[int, ...] = (1,) * PLD_DEFAULT_TOKENS

    def init(self, params, model, cache, prompt_tokens, prompt_lengths, first):
        history = jnp.zeros((prompt_tokens.shape[0], cache.max_len), jnp.int32)
        history = history.at[:, : prompt_tokens.shape[1]].set(prompt_tokens)
        return write_rows(history, first[:, None], prompt_lengths)

    def chain(self, history, cache):
        """int32[B, len(widths)]: the tokens that followed the latest earlier occurrence of the
        history's last n-gram (pld.propose_chain), the root being the history's last token."""
        chain, _ = propose_chain(
            history, cache.lengths + 1, num_tokens=len(self.widths), max_ngram=PLD_MAX_NGRAM, min_ngram=PLD_MIN_NGRAM
        )
        return chain

    def propose(self, params, model, history, roots, cache, attn_impl, sampling, key):
        return chain_tree(roots, self.chain(history, cache)), history

    def accept(self, history, tokens, n_tokens, positions):
        return write_rows(history, tokens, positions)

    def catch_up(self, params, model, history, out, n_out, root_pos):
        """After rounds it did not see (adaptive.py): out int32[B, N] the generated tokens, the first
        n_out[b] valid, the last of them the root at position root_pos[b]. Every generated token
        goes to its position, as accept did round by round; the prompt's stay."""
        first = root_pos - (n_out - 1)  # the first generated token's position
        columns = jnp.arange(history.shape[1], dtype=jnp.int32)[None, :]
        index = columns - first[:, None]
        generated = (index >= 0) & (index < n_out[:, None])
        tokens = jnp.take_along_axis(out, jnp.clip(index, 0, out.shape[1] - 1), axis=1)
        return jnp.where(generated, tokens, history)

    def cache_bytes(self, state) -> int:
        return 0


@struct.dataclass
class DraftParams:
    """A `BlockDraft`'s parameters: the block's (nnx.split in its inference layout) and the head
    it ranks its candidates under (draft_head.py: a candidate vocabulary's rows, int8 rows; None:
    the target's LM head as it is)."""

    block: Any
    head: DraftHead | None = None


@dataclasses.dataclass(frozen=True)
class BlockDraft:
    """The LongSpec draft block (draft.py) behind the calls `DraftProposer` makes; static. Its
    parameters are `DraftParams`. `commit` and `propose_level` return the draft's features,
    `candidates` a tree level's k candidates after them (the likeliest when greedy, the race's
    closest when sampling: draft.draft_candidates), `logits` their next-token logits
    float32[B, T, V] under the shared LM head (-inf outside a candidate vocabulary). A stand-in
    draft (a test oracle) provides the same methods."""

    graphdef: Any
    tree_slots: int
    window: int  # the ring's positions (DraftConfig.window)

    def _block(self, params: DraftParams):
        return nnx.merge(self.graphdef, params.block)

    def init_state(self, params, batch: int):
        return init_draft_state(self._block(params), batch, tree_slots=self.tree_slots)

    def prefill(self, params, target_model, state, tokens, lengths):
        return draft_prefill(self._block(params), target_model, state, tokens, lengths)

    def commit(self, params, target_model, state, tokens, positions, valid, target_k, target_v, attn_impl):
        return draft_commit(
            self._block(params), target_model, state, tokens, positions, valid, target_k, target_v, attn_impl=attn_impl
        )

    def remember(self, params, target_model, state, tokens, positions, valid):
        return draft_remember(self._block(params), target_model, state, tokens, positions, valid)

    def propose_level(
        self, params, target_model, state, tokens, depth, sees, root_positions, target_k, target_v, attn_impl
    ):
        return draft_propose_level(
            self._block(params),
            target_model,
            state,
            tokens,
            depth,
            sees,
            root_positions,
            target_k,
            target_v,
            attn_impl=attn_impl,
        )

    def candidates(self, params, target_model, features, k, attn_impl, sampling, noise, scaled_noise=None):
        return draft_candidates(
            target_model, features, k, sampling, noise, attn_impl=attn_impl, head=params.head, scaled_noise=scaled_noise
        )

    def logits(self, params, target_model, features):
        return draft_logits(target_model, features, params.head)


@struct.dataclass
class DraftProposal:
    """The LongSpec proposer's state: the draft's own (ring and tree slots) and the tokens kept
    last round, which the draft has not seen yet: pending int32[B, D+1], the first n_pending[b]."""

    draft: Any
    pending: jax.Array
    n_pending: jax.Array


@dataclasses.dataclass(frozen=True)
class DraftProposer:
    """pending_rows: room for the tokens kept by one round, the deepest tree's depth + 1 (trees of
    several depths share one state in adaptive.py); 0 means len(widths) + 1."""

    draft: Any
    widths: tuple[int, ...]
    pending_rows: int = 0

    def init(self, params, model, cache, prompt_tokens, prompt_lengths, first):
        b = prompt_tokens.shape[0]
        state = self.draft.prefill(params, model, self.draft.init_state(params, b), prompt_tokens, prompt_lengths)
        rows = self.pending_rows or len(self.widths) + 1
        pending = jnp.zeros((b, rows), jnp.int32).at[:, 0].set(first)
        return DraftProposal(draft=state, pending=pending, n_pending=jnp.ones((b,), jnp.int32))

    @staticmethod
    def _pending_positions(state: DraftProposal, root_pos):
        """(positions, valid) of the pending tokens, which end with the root at root_pos."""
        rows = jnp.arange(state.pending.shape[1], dtype=jnp.int32)[None, :]
        valid = rows < state.n_pending[:, None]
        positions = jnp.where(valid, root_pos[:, None] - state.n_pending[:, None] + 1 + rows, root_pos[:, None])
        return positions, valid

    def catch_up(self, params, model, state: DraftProposal, out, n_out, root_pos):
        """After rounds of another candidate it did not see (adaptive.py):
        out int32[B, N] the generated tokens, the first n_out[b] valid, the last of them the root
        at position root_pos[b]. The `window` tokens before the root go into the ring (K/V only;
        those already there are written again with the same K/V, which depend on token and position
        alone) and the root is pending: the state that writing each round's pending tokens into
        the ring and taking the next round's as pending leaves."""
        w = min(self.draft.window, out.shape[1])
        before_root = n_out[:, None] - 1 - w + jnp.arange(w, dtype=jnp.int32)[None, :]
        valid = before_root >= 0  # earlier tokens are the prompt's, in the ring since prefill
        tokens = jnp.take_along_axis(out, jnp.maximum(before_root, 0), axis=1)
        positions = root_pos[:, None] - (n_out[:, None] - 1) + before_root
        draft = self.draft.remember(params, model, state.draft, tokens, positions, valid)
        root = jnp.take_along_axis(out, (n_out - 1)[:, None], axis=1)
        pending = jnp.zeros_like(state.pending).at[:, :1].set(root)
        return state.replace(draft=draft, pending=pending, n_pending=jnp.ones_like(state.n_pending))

    @property
    def draws(self) -> bool:
        """Whether the tree is a chain drawn at random from the draft (module doc)."""
        return set(self.widths) == {1}

    def _draw(self, params, model, features, sampling, noise):
        """One token per row of features [B, 1, H] from the draft's filtered distribution, by
        Gumbel-max with noise float32[B, V] (zero when greedy: the argmax) -> (a zero score [B, 1, 1],
        the token [B, 1, 1], the filtered logits float32[B, V] it was drawn from, unnormalised)."""
        scores = filtered_logits(self.draft.logits(params, model, features)[:, 0], sampling)
        token = jnp.argmax(scores + noise, axis=-1).astype(jnp.int32)
        return jnp.zeros(token.shape + (1, 1), jnp.float32), token[:, None, None], scores

    def propose(self, params, model, state: DraftProposal, roots, cache, attn_impl, sampling, key):
        """The draft reads the kept tokens (they end with the root), then the beam levels (or the
        chain's draws). A tree's levels are coupled with the target's picks when sampling: one
        Gumbel noise per depth, which the draft's candidates race under and the target's picks use
        (tree.Tree.noise)."""
        root_pos = cache.lengths  # the tokens before the root are all in the cache
        target_k, target_v = cache.k[-1], cache.v[-1]
        positions, valid = self._pending_positions(state, root_pos)
        features, draft = self.draft.commit(
            params, model, state.draft, state.pending, positions, valid, target_k, target_v, attn_impl
        )
        root_row = jnp.maximum(state.n_pending - 1, 0)[:, None, None]
        features = jnp.take_along_axis(features, root_row, axis=1)  # [B, 1, H]: the root's
        vocab = model.config.vocab_size
        drawn_from = []
        tree = None
        # The chain: one draw of noise for its tokens. A tree: one per depth, the leaves' included.
        noise = gumbel_noise(key, (roots.shape[0], len(self.widths) + (not self.draws), vocab), sampling)
        # Scaled once for every level: XLA then slices all of them in one kernel, not one a level.
        scaled_noise = noise * sampling.temperature
        for depth in range(len(self.widths)):
            if depth > 0:
                tokens, _, sees = level_block(tree, depth, root_pos)
                features, draft = self.draft.propose_level(
                    params, model, draft, tokens, depth, sees, root_pos, target_k, target_v, attn_impl
                )
            if self.draws:
                best, tokens, scores = self._draw(params, model, features, sampling, noise[:, depth])
                drawn_from.append(scores)
            else:
                k = min(self.widths[depth], vocab)
                best, tokens = self.draft.candidates(
                    params, model, features, k, attn_impl, sampling, noise[:, depth], scaled_noise[:, depth]
                )
            if depth == 0:
                tree = init_tree_from_top(roots, best[:, 0], tokens[:, 0], self.widths)
            else:
                tree = expand_level_from_top(tree, depth, best, tokens)
        if self.draws:
            tree = tree.replace(drawn_from=jnp.stack(drawn_from, axis=1))
        else:
            tree = tree.replace(noise=noise)
        return tree, state.replace(draft=draft)

    def accept(self, state: DraftProposal, tokens, n_tokens, positions):
        rows = state.pending.shape[1]
        if tokens.shape[1] < rows:  # a shallower tree of an adaptive set: pad to the shared size
            tokens = jnp.pad(tokens, ((0, 0), (0, rows - tokens.shape[1])))
        return state.replace(pending=tokens.astype(jnp.int32), n_pending=n_tokens)

    def cache_bytes(self, state: DraftProposal) -> int:
        return cache_bytes(state.draft)


@struct.dataclass
class LookupProposal:
    """DraftWithLookup's state: the draft's (DraftProposal) and prompt lookup's history."""

    draft: Any
    history: jax.Array


@dataclasses.dataclass(frozen=True)
class DraftWithLookup:
    """The draft's tree with a prompt-lookup chain beside it, both verified in one block
    (tree.with_lookup_chain): a round keeps the longer of what the draft's branches and the chain
    agree with. Where the text repeats its context (a summary quoting its document, code editing
    its own file) the chain keeps more than the draft does; elsewhere it costs its rows in the
    verify. `draft`'s pending rows hold the combined tree's depth + 1."""

    draft: DraftProposer
    lookup: PromptLookup

    @property
    def widths(self) -> tuple[int, ...]:
        return lookup_widths(self.draft.widths, len(self.lookup.widths))

    def init(self, params, model, cache, prompt_tokens, prompt_lengths, first):
        return LookupProposal(
            draft=self.draft.init(params, model, cache, prompt_tokens, prompt_lengths, first),
            history=self.lookup.init(params, model, cache, prompt_tokens, prompt_lengths, first),
        )

    def propose(self, params, model, state: LookupProposal, roots, cache, attn_impl, sampling, key):
        """The draft's tree (its own noise from `key`), then the chain beside it; coupled candidates
        get one more noise for each depth the chain adds."""
        draft_key, chain_key = jax.random.split(key)
        tree, draft = self.draft.propose(params, model, state.draft, roots, cache, attn_impl, sampling, draft_key)
        extra = len(self.widths) - tree.depth
        chain_noise = gumbel_noise(chain_key, (roots.shape[0], extra, model.config.vocab_size), sampling)
        tree = with_lookup_chain(tree, self.lookup.chain(state.history, cache), chain_noise)
        return tree, state.replace(draft=draft)

    def accept(self, state: LookupProposal, tokens, n_tokens, positions):
        return LookupProposal(
            draft=self.draft.accept(state.draft, tokens, n_tokens, positions),
            history=self.lookup.accept(state.history, tokens, n_tokens, positions),
        )

    def cache_bytes(self, state: LookupProposal) -> int:
        return self.draft.cache_bytes(state.draft)


# ----------------------------------------------------------------------------- by mode


def check_draft(draft, target_config) -> None:
    """The draft must have been built for a target of this shape."""
    fields = ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "rope_theta", "rope_scaling")
    mine = draft.target_config
    bad = [f for f in fields if getattr(mine, f) != getattr(target_config, f)]
    if bad:
        differences = ", ".join(f"{f} {getattr(mine, f)} vs {getattr(target_config, f)}" for f in bad)
        raise UserError(
            f"the draft was made for a different target ({differences}): load the draft trained for this target"
        )


def resolve_widths(mode: str, tree_widths, vocab_size: int) -> tuple[int, ...]:
    """The mode's tree widths: longspec defaults to DEFAULT_WIDTHS; pld to a chain of
    PLD_DEFAULT_TOKENS and accepts only chains (all widths 1); ar proposes nothing."""
    if mode == "ar":
        return ()
    if mode == "pld":
        widths = (1,) * PLD_DEFAULT_TOKENS if tree_widths is None else validate_widths(tree_widths, vocab_size)
        if set(widths) != {1}:
            raise UserError(f"mode 'pld' verifies a chain: tree widths must all be 1 (e.g. 1,1,1,1,1), got {widths}")
        return widths
    return validate_widths(DEFAULT_WIDTHS if tree_widths is None else tree_widths, vocab_size)


def draft_parameters(draft, target, small_rows=None, widths=()) -> tuple[Any, DraftParams]:
    """(graphdef, `DraftParams`) of the draft's block in its inference layout
    (`DraftBlock.inference_layout`; small_rows: its products written as multiply-reduce, by default
    the target's choice for the backend) and the head it ranks under (`Draft.head_under`: its
    candidate tokens' rows of `target`'s LM head, int8 rows where its head format says so). widths:
    the trees it will grow (each level needs that many candidates)."""
    rows = tuple(small_rows_for(jax.default_backend()) if small_rows is None else small_rows)
    graphdef, block = nnx.split(draft.inference_block(rows))
    ids = draft.candidate_tokens
    if ids is not None and max(widths, default=0) > len(ids):
        raise UserError(
            f"a tree level of {max(widths)} candidates needs at least that many candidate tokens, the draft has "
            f"{len(ids)}: use narrower --tree-widths, or the whole vocabulary (--full-draft-vocabulary)"
        )
    return graphdef, DraftParams(block, draft.head_under(target.model))


def check_lookup_tokens(mode: str, widths: tuple[int, ...], lookup_tokens: int) -> None:
    """A lookup chain goes beside a draft's tree (mode "longspec", not a drawn chain), and the two
    must fit the verify's block."""
    if not lookup_tokens:
        return
    if lookup_tokens < 0:
        raise UserError(f"lookup_tokens is a token count (0: no lookup chain), got {lookup_tokens}")
    if mode != "longspec":
        raise UserError(
            f"a lookup chain ({lookup_tokens} tokens) goes beside a draft's tree: use it with mode longspec"
        )
    if set(widths) == {1}:
        raise UserError(
            f"tree widths {widths} make a chain drawn from the draft, which takes no lookup chain beside it: "
            "use a tree with a level wider than 1"
        )
    nodes = num_nodes(lookup_widths(widths, lookup_tokens))
    if nodes > MAX_TREE_NODES:
        raise UserError(
            f"tree widths {widths} with a lookup chain of {lookup_tokens} tokens make {nodes} nodes with the root; "
            f"the verification kernel takes at most {MAX_TREE_NODES}: use a smaller tree or a shorter chain"
        )


def proposer_for(
    mode: str, target, draft=None, tree_widths=None, small_rows=None, lookup_tokens: int = 0
) -> tuple[Any, Any]:
    """(static proposer, its parameters) of a mode ("ar", "pld" or "longspec" with a `Draft`);
    small_rows as `draft_parameters`; lookup_tokens > 0 (longspec only): a prompt-lookup chain of
    that many tokens beside the draft's tree (`DraftWithLookup`)."""
    widths = resolve_widths(mode, tree_widths, target.config.vocab_size)
    check_lookup_tokens(mode, widths, lookup_tokens)
    if mode == "ar":
        return NoProposal(), ()
    if mode == "pld":
        return PromptLookup(widths), ()
    if draft is None:
        raise UserError(
            "mode 'longspec' needs a draft: pass draft=load_draft(path, target) (CLI: --draft PATH), "
            "or use mode 'pld' / 'ar'"
        )
    check_draft(draft, target.config)
    graphdef, params = draft_parameters(draft, target, small_rows, widths)
    block = BlockDraft(graphdef, tree_slots=max(1, sum(widths[:-1])), window=draft.config.window)
    if lookup_tokens:
        rows = len(lookup_widths(widths, lookup_tokens)) + 1
        return DraftWithLookup(DraftProposer(block, widths, rows), PromptLookup((1,) * lookup_tokens)), params
    return DraftProposer(block, widths), params
