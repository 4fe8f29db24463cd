"""Dynamic beam search draft trees with static shapes (docs/ALGORITHM.md 5.2-5.3).

A tree of widths W = (W[0], ..., W[D-1]) has depth D and N = 1 + sum(W) flat nodes in breadth-first
order: index 0 is the root (the last token the target emitted, not yet in its cache), then the
W[0] depth-1 nodes, then the W[1] depth-2 nodes, ... Every level is always full: level d + 1 is the
global top-W[d] of (node at level d, token) by cumulative draft log-prob, so a node with no child
simply stays a leaf and nothing moves. Because the candidates are distinct (node, token) pairs, the
children of one node always carry distinct tokens, which the acceptance rules rely on.

The speculative loop builds a tree level by level (the draft runs between levels):
    tree = init_tree(root_tokens, root_log_probs, widths)
    for depth in range(1, len(widths)):
        tokens, positions, mask = level_block(tree, depth, root_positions)
        log_probs = <draft forward of that block>        # [B, W[depth-1], V]
        tree = expand_level(tree, depth, log_probs)
`depth` is a static Python int: levels have different widths, so the loop is unrolled.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from longspec_jax.errors import UserError

# 63 draft nodes and the root: 64 verified rows, a whole query tile of the verify's attention kernel
# without GQA (64 rows) and two at a GQA group of 4 (256), where 69 rows (a last level of 16) ran
# 128-row tiles half empty: on the H200 at 32k cached keys the tree's attention took 17-23 % less a
# layer (Vicuna-7B, Llama-3-8B shapes), and the smaller last level kept as much (SmolLM2 with its
# draft, CPU-measured tau 5.32 / 2.96 on code / summaries against 5.32 / 2.99; BENCHMARKS.md).
DEFAULT_WIDTHS = (4, 16, 16, 16, 11)
# The verification kernel takes the whole tree (root included) as one block of at most this many rows.
MAX_TREE_NODES = 128
# vocab_top_k's selection (timed on the H200 at a 49k vocabulary): below TWO_STAGE_MIN_K one
# argmax pass per winner; from it on two stages up to this many rows, in slices of this many
# entries (a quarter of it above 4 rows).
TWO_STAGE_MIN_K = 8
TWO_STAGE_MAX_ROWS = 16
TWO_STAGE_CHUNK = 1024


@struct.dataclass
class Tree:
    """A draft tree over N = 1 + sum(widths) flat nodes (batch first).

    tokens:  int32[B, N]    token of each node (row 0 is the root).
    parents: int32[B, N]    flat index of each node's parent; -1 for the root.
    scores:  float32[B, N]  cumulative draft log-prob from the root (root 0; 0 along a drawn or
                            prompt-lookup chain, which no beam ranks).
    mask:    bool[B, N, N]  mask[b, i, j]: node j is node i or one of its ancestors.
    widths:  static tuple of level widths.
    drawn_from: float32[B, D, V] or None. A chain whose tokens were drawn at random from the draft
             (proposers.DraftProposer): the distribution node d + 1's token was drawn from, as
             filtered logits (sampling.filtered_logits: log-probs up to a constant per row; when
             greedy the token is their argmax and its verification takes q as the point mass on
             it), which its verification needs (acceptance.accept_drawn_chain). None: the tokens
             are the draft's likeliest, chosen deterministically.
    noise:   float32[B, D+1, V] or None. Coupled candidates (draft.candidates_from_logits): the
             Gumbel noise every node of depth d shares, with which the draft chose level d + 1 and
             with which the target then picks at each depth-d node (acceptance.py). None: each
             node's pick has its own noise.
    Nodes of levels not built yet hold token 0, parent -1, score -inf and an all-False mask row.
    """

    tokens: jax.Array
    parents: jax.Array
    scores: jax.Array
    mask: jax.Array
    widths: tuple[int, ...] = struct.field(pytree_node=False)
    drawn_from: jax.Array | None = None
    noise: jax.Array | None = None

    @property
    def depth(self) -> int:
        return len(self.widths)

    @property
    def depths(self) -> np.ndarray:
        return node_depths(self.widths)


def validate_widths(widths, vocab_size: int) -> tuple[int, ...]:
    """Check tree widths against the vocabulary and the kernel's block limit; return them as a tuple."""
    try:
        widths = tuple(int(w) for w in widths)
    except (TypeError, ValueError):
        raise UserError(f"tree widths must be a sequence of integers like 4,16,16,16,16, got {widths!r}") from None
    if not widths:
        raise UserError("tree widths must name at least one level (depth >= 1), e.g. 4,16,16,16,16")
    if min(widths) < 1:
        raise UserError(f"every tree width must be >= 1, got {widths}")
    fan_in = (1,) + widths[:-1]
    for d, (w, parents) in enumerate(zip(widths, fan_in)):
        if w > parents * vocab_size:
            raise UserError(
                f"tree width {w} at level {d + 1} exceeds the {parents} x {vocab_size} candidates "
                f"(previous width x vocabulary size); use a smaller width"
            )
    if num_nodes(widths) > MAX_TREE_NODES:
        raise UserError(
            f"tree widths {widths} make {num_nodes(widths)} nodes with the root; the verification kernel "
            f"takes at most {MAX_TREE_NODES}: use smaller widths or fewer levels"
        )
    return widths


def num_nodes(widths) -> int:
    """N = 1 + sum(widths): root plus every draft node."""
    return 1 + sum(widths)


def level_slice(widths, depth: int) -> tuple[int, int]:
    """Flat index range [start, end) of the nodes at `depth` (0 = the root alone)."""
    if depth == 0:
        return 0, 1
    start = 1 + sum(widths[: depth - 1])
    return start, start + widths[depth - 1]


def node_depths(widths) -> np.ndarray:
    """int32[N]: depth of every flat node (root 0)."""
    return np.repeat(np.arange(len(widths) + 1), (1,) + tuple(widths)).astype(np.int32)


def _empty_tree(root_tokens: jax.Array, widths: tuple[int, ...]) -> Tree:
    b = root_tokens.shape[0]
    n = num_nodes(widths)
    tokens = jnp.zeros((b, n), jnp.int32).at[:, 0].set(root_tokens.astype(jnp.int32))
    scores = jnp.full((b, n), -jnp.inf, jnp.float32).at[:, 0].set(0.0)
    mask = jnp.zeros((b, n, n), bool).at[:, 0, 0].set(True)
    return Tree(tokens=tokens, parents=jnp.full((b, n), -1, jnp.int32), scores=scores, mask=mask, widths=widths)


def _add_level(tree: Tree, depth: int, parents: jax.Array, tokens: jax.Array, scores: jax.Array) -> Tree:
    """Write level `depth` (parents, tokens, scores: [B, W[depth-1]]); each mask row = parent's row + itself."""
    start, end = level_slice(tree.widths, depth)
    b, n = tree.tokens.shape
    parent_rows = jnp.take_along_axis(tree.mask, parents[:, :, None], axis=1)  # [B, w, N]
    self_cols = jnp.arange(n)[None, None, :] == jnp.arange(start, end)[None, :, None]
    return tree.replace(
        tokens=tree.tokens.at[:, start:end].set(tokens.astype(jnp.int32)),
        parents=tree.parents.at[:, start:end].set(parents.astype(jnp.int32)),
        scores=tree.scores.at[:, start:end].set(scores),
        mask=tree.mask.at[:, start:end, :].set(parent_rows | self_cols),
    )


def vocab_top_k(scores: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """jax.lax.top_k over the last axis (values, indices, ties to the lower index): for k below
    TWO_STAGE_MIN_K over a large vocabulary as k argmax passes (`_argmax_passes`), and in two stages
    when the rows are few and k is larger: the top-k of each slice of CHUNK entries, then the top-k
    of those. The result is the same (every winner is among its own slice's top k, and the second
    stage keeps the slices in order). On the H200 the one-stage kernel takes ~120 us for k = 16
    over a 49k vocabulary at 1-16 rows, the two stages ~20-50 us; at 64 rows one stage is faster."""
    rows = math.prod(scores.shape[:-1])
    v = scores.shape[-1]
    if k < TWO_STAGE_MIN_K and v > 2 * TWO_STAGE_CHUNK:
        return _argmax_passes(scores, k)
    if rows > TWO_STAGE_MAX_ROWS or v <= 2 * TWO_STAGE_CHUNK:
        return jax.lax.top_k(scores, k)
    chunk = TWO_STAGE_CHUNK if rows <= 4 else TWO_STAGE_CHUNK // 4
    slices = -(-v // chunk)
    pad = [(0, 0)] * (scores.ndim - 1) + [(0, slices * chunk - v)]
    padded = jnp.pad(scores, pad, constant_values=-jnp.inf)  # never chosen: v >= k real entries come first
    best, index = jax.lax.top_k(padded.reshape(*scores.shape[:-1], slices, chunk), k)
    index = index + (jnp.arange(slices, dtype=index.dtype) * chunk)[:, None]
    flat_best = best.reshape(*scores.shape[:-1], slices * k)
    values, where = jax.lax.top_k(flat_best, k)
    return values, jnp.take_along_axis(index.reshape(flat_best.shape), where, axis=-1)


def _argmax_passes(scores: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """jax.lax.top_k for a small k as k argmax reductions, each winner then taken out: on the GPU a
    reduction over the vocabulary is a few microseconds where the TopK kernel takes ~150 us at any k.
    Taken entries become -inf and the rest at least the lowest finite value, so every pass picks a
    new index (a row with fewer than k finite scores included), ties to the lower index."""
    scores = scores.astype(jnp.float32)
    lowest = jnp.finfo(jnp.float32).min
    remaining = jnp.maximum(scores, lowest)
    columns = jnp.arange(scores.shape[-1], dtype=jnp.int32)
    values, indices = [], []
    for _ in range(k):
        index = jnp.argmax(remaining, axis=-1).astype(jnp.int32)
        values.append(jnp.take_along_axis(scores, index[..., None], axis=-1)[..., 0])
        indices.append(index)
        remaining = jnp.where(columns == index[..., None], -jnp.inf, remaining)
    return jnp.stack(values, axis=-1), jnp.stack(indices, axis=-1)


def init_tree(root_tokens: jax.Array, root_log_probs: jax.Array, widths=DEFAULT_WIDTHS) -> Tree:
    """Start a tree: root_tokens int32[B], the draft's log-probs at the root float32[B, V].

    Level 1 = the top-W[0] tokens at the root, scored by their log-probs. `widths` is static and
    should have passed `validate_widths`.
    """
    widths = tuple(widths)
    scores, tokens = vocab_top_k(root_log_probs.astype(jnp.float32), widths[0])
    return init_tree_from_top(root_tokens, scores, tokens, widths)


def init_tree_from_top(root_tokens: jax.Array, best: jax.Array, tokens: jax.Array, widths=DEFAULT_WIDTHS) -> Tree:
    """`init_tree` given the root's top-W[0] already: best float32[B, W[0]] (log-probs, descending)
    and tokens int32[B, W[0]] (a draft that selects them as it computes its head, never writing
    the whole vocabulary's log-probs)."""
    widths = tuple(widths)
    tree = _empty_tree(root_tokens, widths)
    return _add_level(tree, 1, jnp.zeros_like(tokens), tokens, best.astype(jnp.float32))


def expand_level(tree: Tree, depth: int, log_probs: jax.Array) -> Tree:
    """Add level depth + 1 from the draft's log-probs at the level-`depth` nodes, float32[B, W[depth-1], V].

    Every (node, token) is scored by node score + token log-prob; the global top-W[depth] become the
    children. Done in two stages (per-node top-W[depth], then global) to keep the sort small: the
    global winners are always among their node's own top-W[depth].
    """
    _check_depth(tree, depth)
    k = min(tree.widths[depth], log_probs.shape[-1])
    node_best, node_tokens = vocab_top_k(log_probs.astype(jnp.float32), k)  # [B, w, k]
    return expand_level_from_top(tree, depth, node_best, node_tokens)


def expand_level_from_top(tree: Tree, depth: int, node_best: jax.Array, node_tokens: jax.Array) -> Tree:
    """`expand_level` given each level-`depth` node's top-k already: node_best float32[B, w, k]
    (log-probs, descending) and node_tokens int32[B, w, k], k = min(W[depth], V)."""
    _check_depth(tree, depth)
    start, end = level_slice(tree.widths, depth)
    b, w, k = node_best.shape
    candidates = (tree.scores[:, start:end, None] + node_best.astype(jnp.float32)).reshape(b, w * k)
    scores, flat = jax.lax.top_k(candidates, tree.widths[depth])
    parents = start + flat // k
    tokens = jnp.take_along_axis(node_tokens.reshape(b, w * k), flat, axis=1)
    return _add_level(tree, depth + 1, parents, tokens, scores)


def _check_depth(tree: Tree, depth: int) -> None:
    if not 1 <= depth < len(tree.widths):
        raise ValueError(f"expand_level depth must be in 1..{len(tree.widths) - 1}, got {depth}")


def level_block(tree: Tree, depth: int, root_positions: jax.Array):
    """The block the draft feeds at tree level `depth` (1..D-1).

    Returns tokens int32[B, w], positions int32[B, w] (= root position + depth) and
    mask bool[B, w, end]: which of the flat nodes [0, end) (root, then every node built so far, this
    level last) each level node attends to. Column 0 is the root (always True); a draft that already
    holds the root in its own cache drops it with mask[:, :, 1:].
    """
    start, end = level_slice(tree.widths, depth)
    tokens = tree.tokens[:, start:end]
    positions = jnp.broadcast_to(root_positions.astype(jnp.int32)[:, None] + depth, tokens.shape)
    return tokens, positions, tree.mask[:, start:end, :end]


def root_tree(root_tokens: jax.Array) -> Tree:
    """The tree of the root alone (widths ()): what AR proposes, verified as a one-token block."""
    return _empty_tree(root_tokens, ())


def chain_tree(root_tokens: jax.Array, chain: jax.Array) -> Tree:
    """A single chain root -> chain[:, 0] -> ... -> chain[:, K-1] (widths (1,) * K), as used by PLD."""
    b, k = chain.shape
    tree = _empty_tree(root_tokens, (1,) * k)
    n = k + 1
    return tree.replace(
        tokens=tree.tokens.at[:, 1:].set(chain.astype(jnp.int32)),
        parents=jnp.broadcast_to(jnp.arange(-1, k, dtype=jnp.int32), (b, n)),
        scores=jnp.zeros((b, n), jnp.float32),
        mask=jnp.broadcast_to(jnp.tril(jnp.ones((n, n), bool)), (b, n, n)),
    )


def lookup_widths(widths, chain_tokens: int) -> tuple[int, ...]:
    """The level widths of a tree of `widths` with a chain of chain_tokens nodes beside it (one
    node more at each of the depths 1..chain_tokens; `with_lookup_chain`)."""
    widths = tuple(widths)
    depth = max(len(widths), chain_tokens)
    return tuple((widths[d] if d < len(widths) else 0) + int(d < chain_tokens) for d in range(depth))


def _lookup_order(widths: tuple[int, ...], chain_tokens: int) -> np.ndarray:
    """int32[N']: for each flat node of the tree of lookup_widths(widths, chain_tokens), its index
    in the tree's nodes followed by the chain's (levels hold the tree's nodes of that depth in their
    order, then the chain's node of that depth)."""
    n = num_nodes(widths)
    depths = np.concatenate([node_depths(widths), np.arange(1, chain_tokens + 1)])
    return np.argsort(depths * (n + chain_tokens) + (np.arange(n + chain_tokens) >= n), kind="stable").astype(np.int32)


def with_lookup_chain(tree: Tree, chain: jax.Array, chain_noise: jax.Array | None = None) -> Tree:
    """`tree` (all levels built) with a chain beside it: chain int32[B, L] (a prompt-lookup chain,
    pld.propose_chain) becomes root -> chain[:, 0] -> ... -> chain[:, L-1], its node of depth d
    placed last in level d of the widths lookup_widths(tree.widths, L). The walk then keeps the
    longer of what the draft's branches and the chain agree with (acceptance.accept): one verify
    serves both.

    A chain token may equal a draft sibling's: both are reached and carry the same prefix, so the
    target's picks below them are the same (greedy, or coupled picks with one noise a depth), and
    the walk keeps the deeper. Coupled candidates (tree.noise [B, D + 1, V]) need a noise for each
    depth the chain adds past the tree's: chain_noise float32[B, max(L - D, 0), V].

    Built by appending the chain's nodes to the tree's and reordering them with one static
    permutation (gathers, which fuse into their readers), not by scatters."""
    if tree.drawn_from is not None:
        raise ValueError("a drawn chain is verified by speculative sampling: it takes no lookup chain beside it")
    b, length = chain.shape
    n = tree.tokens.shape[1]
    order = _lookup_order(tree.widths, length)
    position = np.argsort(order).astype(np.int32)  # where each appended node lands
    # In appended order: chain node i's parent is the root, then chain node i - 1; it sees the root
    # and the chain down to itself.
    chain_parents = np.concatenate([[0], n + np.arange(length - 1)]).astype(np.int32)
    chain_mask = np.zeros((length, n + length), bool)
    chain_mask[:, 0] = True
    chain_mask[:, n:] = np.tril(np.ones((length, length), bool))
    parents = jnp.concatenate([tree.parents, jnp.broadcast_to(jnp.asarray(chain_parents), (b, length))], axis=1)
    parents = jnp.where(parents < 0, -1, jnp.asarray(position)[jnp.maximum(parents, 0)])
    mask = jnp.concatenate(
        [
            jnp.pad(tree.mask, ((0, 0), (0, 0), (0, length))),
            jnp.broadcast_to(jnp.asarray(chain_mask), (b, length, n + length)),
        ],
        axis=1,
    )
    noise, extra = tree.noise, max(length - tree.depth, 0)
    if noise is not None and extra:
        if chain_noise is None or chain_noise.shape[1] != extra:
            raise ValueError(f"coupled candidates need chain_noise of {extra} depths, got {chain_noise}")
        noise = jnp.concatenate([noise, chain_noise], axis=1)
    return Tree(
        tokens=jnp.concatenate([tree.tokens, chain.astype(jnp.int32)], axis=1)[:, order],
        parents=parents[:, order],
        scores=jnp.concatenate([tree.scores, jnp.zeros((b, length), jnp.float32)], axis=1)[:, order],
        mask=mask[:, order][:, :, order],
        widths=lookup_widths(tree.widths, length),
        noise=noise,
    )
