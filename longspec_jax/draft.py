"""The LongSpec draft (docs/ALGORITHM.md 3-5): one decoder block over the target's last-layer KV cache.

Block (pre-norm, three residual sub-blocks, no final norm):
    h   = x + SelfAttn(input_layernorm(x))            sliding window: query i sees keys [i-W, i]
    h   = h + CrossAttn(post_self_attention_layernorm(h))   over the target's last-layer K/V (GQA)
    out = h + MLP(post_cross_attention_layernorm(h))
    logits = target LM head(out)
x is the target's token embedding. The embedding and LM head are the target's: every forward
takes the target `Transformer` (`embed_tokens`, `lm_logits`) as an argument; the draft never holds
them. `DraftBlock.forward` takes the two attentions as functions, so training and inference share
one definition of the block and differ only in how queries meet keys:

- Training (`draft_hidden`, `draft_loss`): a whole sequence; self-attention causal within the
  window (index-based, computed in window-sized chunks); cross-attention "flash noisy" with one lag
  j: query t sees target rows <= t - j, rows t < j get zero (an ordinary causal attention on
  shifted queries, no mask).
- Inference (`init_draft_state`, `draft_prefill`, `draft_commit`, `draft_propose_level`):
  `DraftState` is a fixed-size buffer of the draft's own K/V, `[B, W + R, Hkv, D]`, constant in
  context length:
    slots [0, W)      ring of committed tokens, position p in slot p % W;
    slots [W, W + R)  tree slots: flat tree node i (i >= 1, tree.py's order) in slot W + i - 1.
  `draft_commit` feeds accepted tokens (causal, cross-attention lag 1) and writes them into the
  ring; `draft_propose_level` feeds one tree level, which sees its ancestors through their tree
  slots, and writes the level into its own. A query at position p sees ring / tree-slot keys at
  positions in [p - W, p) plus its own block; the block is attended before it is written, so a
  ring of W slots still gives every query all W + 1 keys of its window. Tree nodes never enter the
  ring: the next commit feeds the accepted path, so rejected branches need no clean-up.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from longspec_jax import attention
from longspec_jax.chunked_loss import chunked_next_token_loss
from longspec_jax.config import ModelConfig
from longspec_jax.draft_head import DraftHead
from longspec_jax.errors import UserError
from longspec_jax.model import MLP, Linear, PackedLinear, PackedMLP, RMSNorm
from longspec_jax.rope import apply_rope, inverse_frequencies
from longspec_jax.sampling import SamplingParams, filtered_logits
from longspec_jax.tree import vocab_top_k

DEFAULT_TREE_SLOTS = 128


def _impl(impl: str | None) -> str:
    return attention.default_impl() if impl is None else impl


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    """window: a query at position p sees the draft's own keys at positions [p - window, p]."""

    window: int = 512


class DraftSelfAttention(nnx.Module):
    """q/k/v (with bias, as the reference, even for Llama targets) and o (no bias)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        h, d = config.hidden_size, config.head_dim
        self.q_proj = Linear(h, config.num_heads * d, bias=True, dtype=jnp.float32, rngs=rngs)
        self.k_proj = Linear(h, config.num_kv_heads * d, bias=True, dtype=jnp.float32, rngs=rngs)
        self.v_proj = Linear(h, config.num_kv_heads * d, bias=True, dtype=jnp.float32, rngs=rngs)
        self.o_proj = Linear(config.num_heads * d, h, bias=False, dtype=jnp.float32, rngs=rngs)
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d

    def keys_values(self, x, positions, inv_freq):
        """k (after RoPE), v: [B, T, Hkv, D]. They depend only on (token, position)."""
        b, t, _ = x.shape
        k = self.k_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        return apply_rope(k, positions, inv_freq), v

    def queries(self, x, positions, inv_freq):
        b, t, _ = x.shape
        return apply_rope(self.q_proj(x).reshape(b, t, self.num_heads, self.head_dim), positions, inv_freq)

    def project(self, x, positions, inv_freq):
        """q, k (after RoPE), v of x [B,T,H]."""
        return self.queries(x, positions, inv_freq), *self.keys_values(x, positions, inv_freq)

    def packed_qkv(self, x):
        """The q|k|v product of x [B,T,H] before RoPE: [B,T,(Hq + 2 Hkv) * D]."""
        return jnp.concatenate([self.q_proj(x), self.k_proj(x), self.v_proj(x)], axis=-1)


class PackedDraftSelfAttention(nnx.Module):
    """`DraftSelfAttention` with q/k/v as one `PackedLinear` (inference layout)."""

    def __init__(self, attn: DraftSelfAttention, small_rows: Sequence[int] = ()):
        self.qkv_proj = PackedLinear([attn.q_proj, attn.k_proj, attn.v_proj], small_rows)
        self.o_proj = PackedLinear([attn.o_proj], small_rows)
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim

    def project(self, x, positions, inv_freq):
        b, t, _ = x.shape
        q, k, v = self.qkv_proj.parts(x)
        q = apply_rope(q.reshape(b, t, self.num_heads, self.head_dim), positions, inv_freq)
        k = apply_rope(k.reshape(b, t, self.num_kv_heads, self.head_dim), positions, inv_freq)
        return q, k, v.reshape(b, t, self.num_kv_heads, self.head_dim)

    def keys_values(self, x, positions, inv_freq):
        """k (after RoPE), v (the q rows of the product are computed and dropped: this serves the
        ring's catch-up and prefill, not the draft's steps)."""
        return self.project(x, positions, inv_freq)[1:]

    def packed_qkv(self, x):
        """The q|k|v product of x [B,T,H] before RoPE: [B,T,(Hq + 2 Hkv) * D]."""
        return self.qkv_proj(x)


class DraftCrossAttention(nnx.Module):
    """Queries (with bias) and output projection. Keys/values are the target's last-layer cache,
    so the reference's cross_attn.k_proj / v_proj are never used and not held here."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        h, d = config.hidden_size, config.head_dim
        self.q_proj = Linear(h, config.num_heads * d, bias=True, dtype=jnp.float32, rngs=rngs)
        self.o_proj = Linear(config.num_heads * d, h, bias=False, dtype=jnp.float32, rngs=rngs)
        self.num_heads, self.head_dim = config.num_heads, d

    def queries(self, x, positions, inv_freq):
        b, t, _ = x.shape
        return apply_rope(self.q_proj(x).reshape(b, t, self.num_heads, self.head_dim), positions, inv_freq)


class DraftBlock(nnx.Module):
    """The draft's only block; sizes and RoPE from the target's ModelConfig. Parameters are
    created float32 (the training master); `Draft.cast` gives a bfloat16 copy for inference.
    Activations run in the parameter dtype."""

    def __init__(self, config: ModelConfig, draft_config: DraftConfig = DraftConfig(), *, rngs: nnx.Rngs):
        h, eps = config.hidden_size, config.rms_norm_eps
        self.config = config
        self.window = draft_config.window
        self.input_layernorm = RMSNorm(h, eps, dtype=jnp.float32)
        self.self_attn = DraftSelfAttention(config, rngs=rngs)
        self.post_self_attention_layernorm = RMSNorm(h, eps, dtype=jnp.float32)
        self.cross_attn = DraftCrossAttention(config, rngs=rngs)
        self.post_cross_attention_layernorm = RMSNorm(h, eps, dtype=jnp.float32)
        self.mlp = MLP(dataclasses.replace(config, mlp_bias=False), dtype=jnp.float32, rngs=rngs)

    @property
    def dtype(self):
        return self.input_layernorm.weight.dtype

    def inv_freq(self) -> jax.Array:
        return jnp.asarray(inverse_frequencies(self.config))

    def inference_layout(self, small_rows: Sequence[int] = (), int8: bool = False) -> DraftBlock:
        """This block with self-attention's q/k/v and the MLP's gate/up packed into one matrix each
        and every matrix stored [out, in] (`PackedLinear`, as the target's `inference_layout`): the
        same function up to float rounding order, five matmuls a step instead of nine, and no
        weight-sized temporary in a one-row product; with int8, its six matrices as int8 rows with a
        float32 scale each (`PackedLinear.to_int8`; the norms and biases stay as they are). For
        inference only; packing a packed block changes nothing."""
        block = nnx.clone(self)
        if isinstance(block.self_attn, DraftSelfAttention):
            block.self_attn = PackedDraftSelfAttention(block.self_attn, small_rows)
            block.cross_attn.q_proj = PackedLinear([block.cross_attn.q_proj], small_rows)
            block.cross_attn.o_proj = PackedLinear([block.cross_attn.o_proj], small_rows)
            block.mlp = PackedMLP(block.mlp, small_rows)
        if int8:
            for product in block.products():
                product.to_int8()
        return block

    def products(self) -> tuple[PackedLinear, ...]:
        """The packed block's six matrix products (q|k|v, o, cross q and o, gate|up, down)."""
        attn, cross, mlp = self.self_attn, self.cross_attn, self.mlp
        return (attn.qkv_proj, attn.o_proj, cross.q_proj, cross.o_proj, mlp.gate_up_proj, mlp.down_proj)

    def self_keys_values(self, x, positions):
        """The self-attention k (after RoPE), v [B,T,Hkv,D] of token embeddings x [B,T,H]."""
        return self.self_attn.keys_values(self.input_layernorm(x.astype(self.dtype)), positions, self.inv_freq())

    def forward(self, x, positions, self_attend: Callable, cross_attend: Callable):
        """x: token embeddings [B,T,H]; positions int32[B,T]. self_attend(xn) -> (o, kept): the
        self-attention of the normed input xn [B,T,H] from its own projection (`self_attn.project`
        or `self_attn.packed_qkv`), o [B,T,Hq,D], and whatever the caller keeps of it;
        cross_attend(q) -> o, with q [B,T,Hq,D] after RoPE. Returns (output features [B,T,H], kept)."""
        b, t, _ = x.shape
        x = x.astype(self.dtype)
        o, kept = self_attend(self.input_layernorm(x))
        h = x + self.self_attn.o_proj(o.astype(x.dtype).reshape(b, t, -1))
        qc = self.cross_attn.queries(self.post_self_attention_layernorm(h), positions, self.inv_freq())
        h = h + self.cross_attn.o_proj(cross_attend(qc).astype(x.dtype).reshape(b, t, -1))
        return h + self.mlp(self.post_cross_attention_layernorm(h)), kept


# ---------------------------------------------------------------- training forward


def flash_noisy_cross_attention(q, k, v, lag, *, impl: str | None = None):
    """Flash Noisy Training: o[t] = attention(q[t], k[:t-lag+1], v[:t-lag+1]) for t >= lag, o[t] = 0
    for t < lag. q [B,L,Hq,D]; k/v [B,L,Hkv,D] (the target's last layer); lag: int32 scalar >= 1,
    may be traced.

    docs/ALGORITHM.md 4 writes it as O[j:] = causal(Q[j:], K[:L-j], V[:L-j]). With static shapes: roll q left
    by j, so row t' holds q[t' + j]; a plain causal attention lets it see keys <= t' = t - j; roll
    the output back right by j and zero the first j rows (whose rolled queries wrapped around)."""
    b, l = q.shape[:2]
    q_shifted = jnp.roll(q.astype(k.dtype), -lag, axis=1)
    o = attention.prefill_attention(q_shifted, k, v, jnp.full((b,), l, jnp.int32), impl=_impl(impl))
    o = jnp.roll(o, lag, axis=1)
    return jnp.where((jnp.arange(l) >= lag)[None, :, None, None], o, 0).astype(q.dtype)


def draft_hidden(
    block: DraftBlock, target_model, tokens, positions, target_k, target_v, lag, *, attn_impl: str | None = None
):
    """The training forward's output features [B,L,H] (before the LM head).

    tokens, positions: int32[B,L] (positions anchor-offset, the same the target saw);
    target_k/v [B,L,Hkv,D]: the target's last-layer K (after RoPE) / V of these tokens;
    lag: int32 scalar j in 1..gamma-1 (flash noisy)."""

    def self_attend(xn):
        q, k, v = block.self_attn.project(xn, positions, block.inv_freq())
        return attention.sliding_window_attention(q, k, v, block.window, impl=_impl(attn_impl)), None

    hidden, _ = block.forward(
        target_model.embed_tokens(tokens),
        positions,
        self_attend,
        lambda q: flash_noisy_cross_attention(q, target_k, target_v, lag, impl=attn_impl),
    )
    return hidden


def draft_loss(
    block: DraftBlock,
    target_model,
    tokens,
    positions,
    label_mask,
    target_k,
    target_v,
    lag,
    *,
    attn_impl: str | None = None,
    chunk_tokens: int = 1024,
    teacher=None,
    distill: float = 0.0,
):
    """Mean next-token cross-entropy of the draft against the ground truth -> (loss, metrics).

    label_mask bool[B,L] marks the tokens to predict (HF "labels" alignment): token t counts when
    label_mask[b, t], predicted from position t - 1; label_mask[:, 0] is ignored. The logits are
    computed `chunk_tokens` rows at a time and never held whole. teacher [B,L,H] / distill: the
    target's final features and the weight of its next-token distribution as the soft label
    (chunked_loss.py). metrics: loss, accuracy (top-1 against the data's tokens), tokens (the
    number of predicted tokens)."""
    hidden = draft_hidden(block, target_model, tokens, positions, target_k, target_v, lag, attn_impl=attn_impl)
    loss_sum, correct, count = chunked_next_token_loss(
        hidden, target_model.lm_logits, tokens, label_mask, chunk_tokens=chunk_tokens, teacher=teacher, distill=distill
    )
    denom = jnp.maximum(count, 1.0)
    loss = loss_sum / denom
    return loss, {"loss": loss, "accuracy": correct / denom, "tokens": count}


# ---------------------------------------------------------------- inference


@struct.dataclass
class DraftState:
    """The draft's own K/V at inference: slots [0, W) a ring of committed tokens (position p in
    slot p % W), slots [W, W + R) tree slots. k (after RoPE), v: [B, W + R, Hkv, D];
    positions: int32[B, W + R], the absolute position each slot holds, -1 when empty."""

    k: jax.Array
    v: jax.Array
    positions: jax.Array

    @property
    def nbytes(self) -> int:
        """Bytes held (works on jax.eval_shape results too)."""
        return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in (self.k, self.v, self.positions))


def init_draft_state(block: DraftBlock, batch: int, *, tree_slots: int = DEFAULT_TREE_SLOTS, dtype=None) -> DraftState:
    """An empty state (every position -1) with W = block.window ring slots and `tree_slots` tree
    slots (static); K/V in `dtype` (default: the block's parameter dtype)."""
    c = block.config
    slots = block.window + tree_slots
    shape = (batch, slots, c.num_kv_heads, c.head_dim)
    dtype = block.dtype if dtype is None else dtype
    return DraftState(
        k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), positions=jnp.full((batch, slots), -1, jnp.int32)
    )


def _write_slots(state: DraftState, slots, k, v, positions) -> DraftState:
    """Write k/v [B,T,Hkv,D] and positions int32[B,T] at slots int32[B,T]; slots outside the
    buffer are dropped."""
    put = lambda buf, new: attention.write_at_slots(buf, slots, new)
    return DraftState(k=put(state.k, k), v=put(state.v, v), positions=put(state.positions, positions))


def draft_prefill(block: DraftBlock, target_model, state: DraftState, tokens, lengths) -> DraftState:
    """Fill the ring from right-padded prompts tokens int32[B,L] with true lengths int32[B]: the
    self-attention K/V of each prompt's last W tokens (positions lengths-W .. lengths-1). Token
    only: self-attention K/V depend on (token, position) alone, so no attention runs (docs/ALGORITHM.md 5.1).
    `state` comes fresh from init_draft_state. Cost and memory do not depend on L."""
    w = block.window
    idx = lengths.astype(jnp.int32)[:, None] - w + jnp.arange(w, dtype=jnp.int32)[None, :]  # [B, W]
    valid = idx >= 0
    window_tokens = jnp.take_along_axis(tokens, jnp.clip(idx, 0, tokens.shape[1] - 1), axis=1)
    k, v = block.self_keys_values(target_model.embed_tokens(window_tokens), idx)
    slots = jnp.where(valid, idx % w, state.positions.shape[1])
    return _write_slots(state, slots, k, v, idx)


def lagged_cross_attention(q, target_k, target_v, cross_len, valid, *, impl: str | None = None):
    """Cross-attention of q [B,T,Hq,D] where query i sees target rows [0, cross_len[b, i]).

    Hybrid identity: with c = min over valid queries of cross_len, rows [0, c) are visible to
    every query (the cache part, no mask) and the rest lies in rows [c, c + T) (a T-row block under
    a mask). Needs max_i cross_len - min_i cross_len <= T over valid queries, which holds for
    commits (consecutive positions, lag 1) and tree levels (one prefix for all). Requires S >= T."""
    b, t = cross_len.shape
    s = target_k.shape[1]
    big = jnp.iinfo(jnp.int32).max
    c_min = jnp.min(jnp.where(valid, cross_len, big), axis=1)
    start = jnp.clip(jnp.where(c_min == big, 0, c_min), 0, s - t).astype(jnp.int32)  # [B]
    take = jax.vmap(lambda x, r: jax.lax.dynamic_slice_in_dim(x, r, t, axis=0))
    k_blk, v_blk = take(target_k, start), take(target_v, start)
    rows = start[:, None] + jnp.arange(t)[None, :]  # [B, T]
    blk_mask = rows[:, None, :] < cross_len[:, :, None]
    o = attention.hybrid_tree_attention(
        q.astype(target_k.dtype), target_k, target_v, start, k_blk, v_blk, blk_mask, impl=_impl(impl)
    )
    return o.astype(q.dtype)


def prefix_cross_attention(q, target_k, target_v, prefix_len, *, impl: str | None = None):
    """Cross-attention of q [B,T,Hq,D] where every query of row b sees target rows
    [0, prefix_len[b]): a tree level's, whose nodes all follow the same verified prefix. The plain
    cache attention, with no masked block beside it (`lagged_cross_attention` with one cross_len
    for all queries, in fewer kernels)."""
    o, _ = attention.cache_attention(q.astype(target_k.dtype), target_k, target_v, prefix_len, impl=_impl(impl))
    return o.astype(q.dtype)


def _forward_block(
    block: DraftBlock,
    target_model,
    state: DraftState,
    tokens,
    positions,
    valid,
    cross_attend: Callable,
    *,
    tree_slots_seen,
    block_seen,
    write_slots,
):
    """One draft forward of a block of T tokens over the ring, the tree slots and itself, the
    block's K/V then written into the state -> (features [B,T,H]: the block's output before the LM
    head, the new state). cross_attend(q) -> o: the cross-attention over the target's cache.
    tree_slots_seen bool[B,T,R]: the tree slots each query sees; block_seen bool[B,T,T]: the block
    tokens each query sees; write_slots int32[B,T]: where each token goes (W + R or more: nowhere).
    The block is attended before it is written, so a commit that overwrites ring slots still
    gives its queries the keys they held."""
    w = block.window
    b, t = tokens.shape
    p = positions[:, :, None]

    def in_window(key_pos):
        return (key_pos >= 0) & (key_pos >= p - w)

    slot_pos = state.positions[:, None, :]  # [B, 1, W + R]
    ring_or_tree = jnp.concatenate([jnp.ones((b, t, w), bool), tree_slots_seen], -1)
    slots_visible = in_window(slot_pos) & (slot_pos < p) & ring_or_tree
    block_visible = in_window(positions[:, None, :]) & block_seen & valid[:, None, :]

    def self_attend(xn):
        o, k, v, slot_positions = attention.attend_and_write_slots(
            block.self_attn.packed_qkv(xn),
            block.inv_freq(),
            state.k,
            state.v,
            state.positions,
            jnp.concatenate([slots_visible, block_visible], axis=-1),
            write_slots,
            positions,
            num_heads=block.config.num_heads,
        )
        return o, DraftState(k=k, v=v, positions=slot_positions)

    return block.forward(target_model.embed_tokens(tokens), positions, self_attend, cross_attend)


def _fused_head_top_k(target_model, features, k: int, noise=None, head: DraftHead | None = None):
    """`head_top_k` over the draft's head for features [B,T,H] (noise [B, V] or None) -> [B,T,k]
    each: the target's head as it is, or `head` (a candidate vocabulary's rows, int8 rows; ids
    mapped back to the vocabulary's)."""
    b, t, h = features.shape
    if head is None:
        rows = target_model.embed[...] if target_model.lm_head is None else target_model.lm_head[...]
        head = DraftHead(rows, None, None)
    try:
        best, ids = head.top_k(features.reshape(b * t, h), k, noise)
    except ValueError as err:  # a head the kernel cannot take: the user's choice of impl
        raise UserError(f"{err}; use attn_impl 'xla' for this model") from err
    return best.reshape(b, t, k), ids.reshape(b, t, k)


def draft_logits(target_model, features, head: DraftHead | None = None) -> jax.Array:
    """The draft's next-token logits float32[B,T,V] after features [B,T,H] under its head: the
    target's LM head as it is, or `head` (-inf at tokens outside a candidate vocabulary)."""
    if head is None:
        return target_model.lm_logits(features)
    return head.full_logits(head.logits(features), target_model.config.vocab_size)


def draft_top_k(target_model, features, k: int, *, attn_impl=None):
    """The k most likely next tokens after each of features [B,T,H] (the draft's output) under the
    target's LM head -> (log-probs float32[B,T,k] descending, token ids int32[B,T,k]).

    With the Pallas kernels one kernel computes the head and keeps each vocabulary tile's best k
    (`head_top_k`): the [B,T,V] logits are never written, and XLA's top-k over the whole vocabulary
    (its largest cost in a draft step on the H200) is not run. Otherwise the logits, their log-softmax
    and `tree.vocab_top_k`. The two agree up to float rounding: the candidates of a tree need not be
    exact for the output to be, the target's check is."""
    if _impl(attn_impl) == "pallas":
        return _fused_head_top_k(target_model, features, k)
    return vocab_top_k(jax.nn.log_softmax(target_model.lm_logits(features), axis=-1), k)


def candidates_from_logits(logits, k: int, sampling: SamplingParams, noise):
    """A tree level's k candidates after each node from the draft's next-token logits [B,T,V] ->
    (scores float32[B,T,k] descending, token ids int32[B,T,k]). Greedy: the likeliest, scored by
    log-prob. Sampling: the k tokens closest to winning the Gumbel race that the target's picks at
    these nodes run with the same noise float32[B, V] (acceptance.py): each token's perturbed score
    (filtered logit / T + noise) less its node's best, 0 for the winner; summed down a path
    (tree.expand_level_from_top) these margins rank a level's candidates as log-probs do in a beam."""
    logits = logits.astype(jnp.float32)
    raced = filtered_logits(logits, sampling) + noise[:, None, :]
    best, ids = vocab_top_k(jnp.where(sampling.greedy, jax.nn.log_softmax(logits, axis=-1), raced), k)
    return jnp.where(sampling.greedy, best, best - best[..., :1]), ids


def draft_candidates(
    target_model,
    features,
    k: int,
    sampling: SamplingParams,
    noise,
    *,
    attn_impl=None,
    head: DraftHead | None = None,
    scaled_noise=None,
):
    """`candidates_from_logits` for the draft's features [B,T,H] under the target's LM head, the
    noise float32[B, V] zero when greedy; with a `DraftHead`, under its rows (a candidate
    vocabulary's tokens alone, int8 rows: draft_head.py). With the Pallas kernels and no top-k / top-p filter, one
    `head_top_k` pass ranks logit + T * noise (the order of logit / T + noise) and returns
    log-prob + T * noise: the log-probs when greedy, the margins once less the best and over T.
    scaled_noise: T * noise where the caller made it (a tree's levels, all in one kernel), else
    made here. No branch on the traced greedy flag: a conditional cost each tree level ~10 us on
    the H200."""
    if _impl(attn_impl) == "pallas" and not (sampling.use_top_k or sampling.use_top_p):
        scaled_noise = noise * sampling.temperature if scaled_noise is None else scaled_noise
        best, ids = _fused_head_top_k(target_model, features, k, scaled_noise, head)
        return jnp.where(sampling.greedy, best, (best - best[..., :1]) / sampling.temperature), ids
    return candidates_from_logits(draft_logits(target_model, features, head), k, sampling, noise)


def tree_slots(state: DraftState, window: int) -> int:
    """R, the number of tree slots of a state (static)."""
    return state.positions.shape[1] - window


def draft_commit(
    block: DraftBlock, target_model, state: DraftState, tokens, positions, valid, target_k, target_v, *, attn_impl=None
):
    """Feed accepted tokens and write them into the ring -> (features [B,T,H], new state): the
    draft's outputs, whose next-token candidates `draft_top_k` gives.

    tokens, positions int32[B,T] (consecutive per row); valid bool[B,T] (padding rows give junk
    features, are never written and are invisible as keys); target_k/v [B,S,Hkv,D]: the target's
    last-layer cache (cache.k[-1], cache.v[-1]). Causal within the block; cross-attention lag 1:
    the token at position t sees target rows [0, t)."""
    b, t = tokens.shape
    return _forward_block(
        block,
        target_model,
        state,
        tokens,
        positions,
        valid,
        lambda q: lagged_cross_attention(q, target_k, target_v, positions, valid, impl=_impl(attn_impl)),
        tree_slots_seen=jnp.zeros((b, t, tree_slots(state, block.window)), bool),
        block_seen=jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t)),
        write_slots=jnp.where(valid, positions % block.window, state.positions.shape[1]),
    )


def draft_propose_level(
    block: DraftBlock,
    target_model,
    state: DraftState,
    tokens,
    depth: int,
    sees,
    root_positions,
    target_k,
    target_v,
    *,
    attn_impl=None,
):
    """Feed one tree level and keep it in its tree slots -> (features [B,w,H], new state).

    tokens int32[B,w]: the level's nodes, flat nodes [end - w, end) of the tree; depth: the level's
    depth (static, >= 1); sees bool[B,w,end]: which flat nodes [0, end) each node sees, itself and
    its ancestors (tree.level_block's mask; column 0, the root, is already in the ring);
    root_positions int32[B]. Every node sees the target prefix [0, root position)."""
    w = tokens.shape[1]
    end = sees.shape[2]
    start = end - w
    r = tree_slots(state, block.window)
    if end - 1 > r:
        raise ValueError(f"tree nodes up to {end - 1} exceed the draft state's {r} tree slots")
    b = tokens.shape[0]
    positions = jnp.broadcast_to(root_positions[:, None] + depth, (b, w)).astype(jnp.int32)
    ancestors = jnp.zeros((b, w, r), bool).at[:, :, : start - 1].set(sees[:, :, 1:start])
    return _forward_block(
        block,
        target_model,
        state,
        tokens,
        positions,
        jnp.ones((b, w), bool),
        lambda q: prefix_cross_attention(q, target_k, target_v, root_positions, impl=_impl(attn_impl)),
        tree_slots_seen=ancestors,
        block_seen=sees[:, :, start:],
        write_slots=jnp.broadcast_to(
            np.arange(block.window + start - 1, block.window + end - 1, dtype=np.int32), (b, w)
        ),
    )


def draft_remember(block: DraftBlock, target_model, state: DraftState, tokens, positions, valid) -> DraftState:
    """Write accepted tokens into the ring without running the block: their self-attention K/V
    depend on (token, position) alone, so this equals what `draft_commit` writes for them, at the
    cost of one projection (no attention, no LM head). For rounds in which the draft proposed
    nothing. tokens, positions int32[B,T]; valid bool[B,T] (invalid rows are not written)."""
    k, v = block.self_keys_values(target_model.embed_tokens(tokens), positions)
    slots = jnp.where(valid, positions % block.window, state.positions.shape[1])
    return _write_slots(state, slots, k, v, positions)
