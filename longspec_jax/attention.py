"""The attention-op module: every attention in the target and the draft goes through here.

Two entry points, each with implementations chosen by `impl`:
- `prefill_attention`: a block of L tokens against itself, causal, per-sequence lengths (the cache
  is empty before it).
- `hybrid_tree_attention`: T new queries against a cache (every query sees cache keys
  [0, cache_len[b]) with no mask) plus the T' new keys under a boolean mask (a tree mask in
  verification, a lower-triangular one for plain blocks, [[True]] for one-token decode).

Layouts: q [B, T, Hq, D]; k, v [B, S, Hkv, D]; query head h reads KV head h // (Hq // Hkv)
(HF's repeat_kv grouping). Softmax in float32; outputs in q.dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = float("-inf")


def _grouped_scores(q: jnp.ndarray, k: jnp.ndarray, scale: float) -> jnp.ndarray:
    """float32 scores [B, Hkv, G, T, S] with G = Hq // Hkv query heads per KV head."""
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, t, hkv, hq // hkv, d)
    return jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale


def _grouped_output(p: jnp.ndarray, v: jnp.ndarray) -> jnp.ndarray:
    """p [B, Hkv, G, T, S] (float32), v [B, S, Hkv, D] -> [B, T, Hkv * G, D] float32."""
    o = jnp.einsum("bkgts,bskd->btkgd", p, v.astype(jnp.float32))
    b, t, hkv, g, d = o.shape
    return o.reshape(b, t, hkv * g, d)


def masked_softmax_attention(q, k, v, mask, *, scale=None):
    """Dense reference: q [B,T,Hq,D], k/v [B,S,Hkv,D], mask bool[B,T,S] -> (o [B,T,Hq,D], lse [B,Hq,T]).

    A fully masked row gives o = 0 and lse = -inf.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = _grouped_scores(q, k, scale)
    s = jnp.where(mask[:, None, None, :, :], s, NEG_INF)
    m = jnp.max(s, axis=-1, keepdims=True)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m_safe)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    o = _grouped_output(p / jnp.where(denom > 0, denom, 1.0), v)
    lse = (jnp.log(denom) + m_safe)[..., 0]  # [B, Hkv, G, T]; -inf where fully masked
    b, hkv, g, t = lse.shape
    return o.astype(q.dtype), lse.reshape(b, hkv * g, t)


def _prefill_xla(q, k, v, lengths, scale):
    t = q.shape[1]
    pos = jnp.arange(t)
    mask = (pos[None, :, None] >= pos[None, None, :]) & (pos[None, None, :] < lengths[:, None, None])
    o, _ = masked_softmax_attention(q, k, v, mask, scale=scale)
    return o


def prefill_attention(q, k, v, lengths, *, impl: str = "xla", scale=None):
    """Causal self-attention of a block of L tokens: q [B,L,Hq,D], k/v [B,L,Hkv,D], lengths int32[B].

    Query i sees keys j <= i with j < lengths[b]; rows past lengths[b] are padding (any finite value).
    """
    if impl == "xla":
        return _prefill_xla(q, k, v, lengths, scale)
    raise ValueError(f"unknown attention impl {impl!r} for prefill_attention")


def _hybrid_xla(q, k_cache, v_cache, cache_len, k_new, v_new, tree_mask, scale):
    """One dense masked attention over the concatenated keys (the reference for the hybrid)."""
    s = k_cache.shape[1]
    cache_mask = jnp.arange(s)[None, None, :] < cache_len[:, None, None]
    cache_mask = jnp.broadcast_to(cache_mask, (q.shape[0], q.shape[1], s))
    mask = jnp.concatenate([cache_mask, tree_mask], axis=-1)
    k = jnp.concatenate([k_cache, k_new.astype(k_cache.dtype)], axis=1)
    v = jnp.concatenate([v_cache, v_new.astype(v_cache.dtype)], axis=1)
    o, _ = masked_softmax_attention(q, k, v, mask, scale=scale)
    return o


def hybrid_tree_attention(q, k_cache, v_cache, cache_len, k_new, v_new, tree_mask, *, impl: str = "xla", scale=None):
    """q [B,T,Hq,D] against cache keys [0, cache_len[b]) of k_cache/v_cache [B,S,Hkv,D] (no mask)
    plus new keys k_new/v_new [B,T',Hkv,D] under tree_mask bool[B,T,T']. Returns o [B,T,Hq,D]."""
    if impl == "xla":
        return _hybrid_xla(q, k_cache, v_cache, cache_len, k_new, v_new, tree_mask, scale)
    raise ValueError(f"unknown attention impl {impl!r} for hybrid_tree_attention")


def default_impl() -> str:
    """The attention implementation for the default backend: the fastest measured on GPU, xla elsewhere."""
    return "xla" if jax.default_backend() != "gpu" else "xla"
