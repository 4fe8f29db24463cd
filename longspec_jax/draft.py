"""The LongSpec draft (SPEC.md 3-5): one decoder block over the target's last-layer KV cache.

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
- Inference (`init_draft_state`, `draft_prefill`, `draft_step`): `DraftState` is a fixed-size
  buffer of the draft's own K/V, `[B, W + R, Hkv, D]`, constant in context length:
    slots [0, W)      ring of committed tokens, position p in slot p % W;
    slots [W, W + R)  tree slots: K/V of uncommitted tree nodes, addressed by the caller.
  A step's queries see ring/tree-slot keys at positions in [p - W, p) (tree slots also only where
  `slot_mask` says so) plus the step's own block under `tree_mask`. The block is attended before it
  is written, so a ring of W slots still gives every query all W + 1 keys of its window.
  `commit=True` (step 0: the tokens accepted last round) writes the valid tokens into the ring;
  `commit=False` (tree levels) writes the block into tree slots [tree_offset, tree_offset + T),
  where later levels reach them as ancestors through `slot_mask`. Tree nodes never enter the ring:
  the next step 0 re-feeds the accepted path, so rejected branches need no clean-up.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from longspec_jax import attention
from longspec_jax.chunked_loss import chunked_next_token_loss
from longspec_jax.config import ModelConfig
from longspec_jax.model import MLP, Linear, RMSNorm
from longspec_jax.rope import apply_rope, inverse_frequencies

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

    def self_keys_values(self, x, positions):
        """The self-attention k (after RoPE), v [B,T,Hkv,D] of token embeddings x [B,T,H]."""
        return self.self_attn.keys_values(self.input_layernorm(x.astype(self.dtype)), positions, self.inv_freq())

    def forward(self, x, positions, self_attend: Callable, cross_attend: Callable):
        """x: token embeddings [B,T,H]; positions int32[B,T]. self_attend(q, k, v) -> o and
        cross_attend(q) -> o, with q [B,T,Hq,D] after RoPE. Returns (output features [B,T,H],
        (k, v) the block's self-attention keys (after RoPE) and values [B,T,Hkv,D])."""
        b, t, _ = x.shape
        inv_freq = self.inv_freq()
        x = x.astype(self.dtype)
        xn = self.input_layernorm(x)
        q = self.self_attn.queries(xn, positions, inv_freq)
        k, v = self.self_attn.keys_values(xn, positions, inv_freq)
        h = x + self.self_attn.o_proj(self_attend(q, k, v).astype(x.dtype).reshape(b, t, -1))
        qc = self.cross_attn.queries(self.post_self_attention_layernorm(h), positions, inv_freq)
        h = h + self.cross_attn.o_proj(cross_attend(qc).astype(x.dtype).reshape(b, t, -1))
        return h + self.mlp(self.post_cross_attention_layernorm(h)), (k, v)


# ---------------------------------------------------------------- training forward


def sliding_window_attention(q, k, v, window: int, *, impl: str | None = None):
    """Causal self-attention where query i sees keys [i - window, i] (by index).

    q [B,L,Hq,D], k/v [B,L,Hkv,D]. On GPU with bf16/f16 inputs and impl "cudnn" or "pallas": cuDNN
    flash attention with a (window, 0) local window. Otherwise computed in chunks of
    C = min(window, L) queries, each against its own and the previous chunk's keys (which hold its
    whole window), so memory is O(L * 2C) rather than O(L^2)."""
    if _impl(impl) != "xla" and attention._cudnn_unusable(q) is None:
        return jax.nn.dot_product_attention(
            q, k, v, is_causal=True, local_window_size=(window, 0), implementation="cudnn"
        ).astype(q.dtype)
    return _chunked_window_attention(q, k, v, window)


def _chunked_window_attention(q, k, v, window: int):
    b, l, hq, d = q.shape
    hkv = k.shape[2]
    c = min(window, l)
    n = -(-l // c)
    pad = n * c - l
    padded = lambda x: jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, n, c, *x.shape[2:])
    qc, kc, vc = padded(q), padded(k), padded(v)
    with_previous = lambda x: jnp.concatenate([jnp.concatenate([jnp.zeros_like(x[:, :1]), x[:, :-1]], 1), x], 2)
    kk, vv = with_previous(kc), with_previous(vc)  # [B, n, 2C, Hkv, D]
    q_idx = np.arange(n)[:, None] * c + np.arange(c)[None, :]  # [n, C]
    k_idx = (np.arange(n)[:, None] - 1) * c + np.arange(2 * c)[None, :]  # [n, 2C]
    diff = q_idx[:, :, None] - k_idx[:, None, :]
    mask = (diff >= 0) & (diff <= window) & (k_idx[:, None, :] >= 0)  # [n, C, 2C], static
    mask = jnp.broadcast_to(jnp.asarray(mask), (b, n, c, 2 * c)).reshape(b * n, c, 2 * c)
    o, _ = attention.masked_softmax_attention(
        qc.reshape(b * n, c, hq, d), kk.reshape(b * n, 2 * c, hkv, d), vv.reshape(b * n, 2 * c, hkv, d), mask
    )
    return o.reshape(b, n * c, hq, d)[:, :l]


def flash_noisy_cross_attention(q, k, v, lag, *, impl: str | None = None):
    """Flash Noisy Training: o[t] = attention(q[t], k[:t-lag+1], v[:t-lag+1]) for t >= lag, o[t] = 0
    for t < lag. q [B,L,Hq,D]; k/v [B,L,Hkv,D] (the target's last layer); lag: int32 scalar >= 1,
    may be traced.

    SPEC.md 4 writes it as O[j:] = causal(Q[j:], K[:L-j], V[:L-j]). With static shapes: roll q left
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
    hidden, _ = block.forward(
        target_model.embed_tokens(tokens),
        positions,
        lambda q, k, v: sliding_window_attention(q, k, v, block.window, impl=attn_impl),
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
):
    """Mean next-token cross-entropy of the draft against the ground truth -> (loss, metrics).

    label_mask bool[B,L] marks the tokens to predict (HF "labels" alignment): token t counts when
    label_mask[b, t], predicted from position t - 1; label_mask[:, 0] is ignored. The logits are
    computed `chunk_tokens` rows at a time and never held whole. metrics: loss, accuracy (top-1),
    tokens (the number of predicted tokens)."""
    hidden = draft_hidden(block, target_model, tokens, positions, target_k, target_v, lag, attn_impl=attn_impl)
    loss_sum, correct, count = chunked_next_token_loss(
        hidden, target_model.lm_logits, tokens, label_mask, chunk_tokens=chunk_tokens
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
    rows = jnp.arange(k.shape[0])[:, None]
    put = lambda buf, new: buf.at[rows, slots].set(new.astype(buf.dtype), mode="drop")
    return DraftState(k=put(state.k, k), v=put(state.v, v), positions=put(state.positions, positions))


def draft_prefill(block: DraftBlock, target_model, state: DraftState, tokens, lengths) -> DraftState:
    """Fill the ring from right-padded prompts tokens int32[B,L] with true lengths int32[B]: the
    self-attention K/V of each prompt's last W tokens (positions lengths-W .. lengths-1). Token
    only: self-attention K/V depend on (token, position) alone, so no attention runs (SPEC.md 5.1).
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
    step 0 (consecutive positions, lag 1) and tree levels (one prefix for all). Requires S >= T."""
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


def draft_step(
    block: DraftBlock,
    target_model,
    state: DraftState,
    tokens,
    positions,
    valid,
    target_k,
    target_v,
    cross_len,
    tree_mask,
    *,
    commit: bool,
    slot_mask=None,
    tree_offset=0,
    attn_impl: str | None = None,
):
    """One draft forward over a block of T tokens -> (logits float32[B,T,V], new state).

    tokens, positions: int32[B,T]; valid: bool[B,T] (padding rows give junk logits, are never
    written to the ring and are invisible as keys); target_k/v [B,S,Hkv,D]: the target's
    last-layer cache (cache.k[-1], cache.v[-1]); cross_len int32[B,T]: target rows
    [0, cross_len) visible to each query (step 0, lag 1: the query at position t gets t; tree
    level: root position for all); tree_mask bool[B,T,T]: which block tokens each query sees
    (step 0: causal; a tree level: each node itself).
    commit (static): True writes the valid tokens into the ring (step 0); False writes the block
    into tree slots [tree_offset, tree_offset + T) (int or int32 scalar), their positions -1
    where not valid. slot_mask bool[B,T,R]: the tree slots each query sees (a tree level: its
    ancestors); None: none. Keys in the ring and tree slots are also limited to positions
    [p - W, p) for a query at p."""
    w = block.window
    b, t = tokens.shape
    num_slots = state.positions.shape[1]
    x = target_model.embed_tokens(tokens)
    p = positions[:, :, None]

    def in_window(key_pos):
        return (key_pos >= 0) & (key_pos >= p - w)

    slot_pos = state.positions[:, None, :]  # [B, 1, W + R]
    tree_visible = jnp.zeros((b, t, num_slots - w), bool) if slot_mask is None else slot_mask
    slots_visible = (
        in_window(slot_pos) & (slot_pos < p) & jnp.concatenate([jnp.ones((b, t, w), bool), tree_visible], -1)
    )
    block_pos = positions[:, None, :]
    block_visible = in_window(block_pos) & tree_mask & valid[:, None, :]
    mask = jnp.concatenate([slots_visible, block_visible], axis=-1)

    def self_attend(q, k, v):
        keys = jnp.concatenate([state.k, k.astype(state.k.dtype)], axis=1)
        values = jnp.concatenate([state.v, v.astype(state.v.dtype)], axis=1)
        return attention.masked_softmax_attention(q.astype(state.k.dtype), keys, values, mask)[0]

    out, (k, v) = block.forward(
        x,
        positions,
        self_attend,
        lambda q: lagged_cross_attention(q, target_k, target_v, cross_len, valid, impl=attn_impl),
    )
    logits = target_model.lm_logits(out)
    if commit:
        slots = jnp.where(valid, positions % w, num_slots)
        new_positions = positions
    else:
        if isinstance(tree_offset, int) and not 0 <= tree_offset <= num_slots - w - t:
            raise ValueError(f"tree slots [{tree_offset}, {tree_offset + t}) exceed the {num_slots - w} tree slots")
        slots = jnp.broadcast_to(w + tree_offset + jnp.arange(t, dtype=jnp.int32), (b, t))
        new_positions = jnp.where(valid, positions, -1)
    return logits, _write_slots(state, slots, k, v, new_positions)
