"""The attention-op module: every attention in the target and the draft goes through here, and
it is the door to the Pallas attention kernels (their `ValueError`s come out as `UserError`; the
one other kernel, the cache commit, is called by `model.commit`).

Entry points, with implementations chosen by `impl` ("xla", "cudnn", "pallas"):
- `prefill_attention`: a block of L tokens against itself, causal, per-sequence lengths (the cache
  is empty before it).
- `hybrid_tree_attention`: T new queries against a cache (every query sees cache keys
  [0, cache_len[b]) with no mask) plus the T' new keys under a boolean mask (a tree mask in
  verification, a lower-triangular one for plain blocks, [[True]] for one-token decode).
- `attend_and_write_block`: a block of new tokens from the packed, un-rotated q|k|v product:
  rotates, writes their K/V rows into the cache and attends the cache plus the block under its
  mask. AR decoding's one token under every impl; under "pallas" a verified tree too, all in the
  fused kernel, whose outputs include the caches, aliased to its inputs (a 64-token verify on a
  Hopper GPU, `cache_on_hopper_units`: a kernel that rotates and writes the rows, then the Mosaic
  GPU kernel and the combine).
- `sliding_window_attention`: the draft's training self-attention, causal within a window
  (cuDNN local window on GPU, else XLA in window-sized chunks).
- `attend_and_write_slots`: the draft's inference self-attention, a block of tokens from its
  q|k|v product against the draft's fixed-size ring and tree slots and against itself under a
  boolean mask, then written into the slots (dense XLA: the slots hold at most a window and a tree
  of keys, nothing a flash kernel could skip).

The hybrid splits the keys (docs/ALGORITHM.md 6): attention over the cache and over the new keys
each give (o, lse), combined exactly. impl "pallas" does it all in the fused Pallas kernel (the new
keys are one more split of its split-K grid) and a Pallas combine; "cudnn" runs cuDNN flash over the
cache and the Pallas `masked_attention` over the new keys, then `merge_attention`; "xla" does both
sides as dense XLA attention (the CPU default). The kernels are tested against float64 references of
one attention over the concatenated keys.

Layouts: q [B, T, Hq, D]; k, v [B, S, Hkv, D]; query head h reads KV head h // (Hq // Hkv)
(HF's repeat_kv grouping). Softmax in float32; outputs in q.dtype; lse float32 [B, Hq, T].
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np

from longspec_jax.errors import UserError
from longspec_jax.rope import rope_tables, rotate
from pallas_kernels import cache_attention as pallas_cache
from pallas_kernels import cache_attention_mgpu as mgpu_cache
from pallas_kernels import flash_block
from pallas_kernels import hybrid_attention as pallas_hybrid
from pallas_kernels import rotate_and_write as pallas_rotate
from pallas_kernels import tree_attention as pallas_tree

__all__ = [
    "cache_attention",
    "decode_attention",
    "attend_and_write_block",
    "default_impl",
    "hybrid_tree_attention",
    "masked_attention",
    "attend_and_write_slots",
    "masked_softmax_attention",
    "merge_attention",
    "prefill_attention",
    "sliding_window_attention",
    "write_at_slots",
    "write_cache_rows",
]

IMPLS = ("xla", "cudnn", "pallas")
# Cache rows come in whole tiles of this many for the Mosaic GPU route (its own-keys tile); a cache
# sized in them keeps every attention kernel's fast path (decode_kit.plan_lengths).
CACHE_ROW_TILE = mgpu_cache.OWN_ROWS

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


def _kernel(kernel, *args, **kwargs):
    """A Pallas kernel call; the kernel's ValueError (shapes or dtypes it cannot take) is the
    user's to fix, so it comes out as a UserError."""
    try:
        return kernel(*args, **kwargs)
    except UserError:
        raise
    except ValueError as err:
        raise UserError(str(err)) from err


def masked_attention(q, k, v, mask, *, scale=None):
    """The Pallas masked kernel: q [B,T,Hq,D] against k/v [B,T',Hkv,D] under mask bool[B,T,T'] ->
    (o [B,T,Hq,D], lse float32 [B,Hq,T])."""
    return _kernel(pallas_tree.masked_attention, q, k, v, mask, scale=scale)


def _check_impl(impl: str, where: str) -> None:
    if impl not in IMPLS:
        raise UserError(f"{where}: unknown attention impl {impl!r}; use one of {IMPLS}")


def _cudnn_unusable(q) -> str | None:
    """Why cuDNN flash attention cannot run these inputs here, or None when it can."""
    if jax.default_backend() != "gpu":
        return "no GPU"
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"cuDNN attention needs bfloat16/float16, got {q.dtype}"
    if q.shape[-1] % 8 or q.shape[-1] > 256:
        return f"cuDNN attention needs head dim <= 256 and a multiple of 8, got {q.shape[-1]}"
    return None


def _fallback_warning(what: str, reason) -> None:
    warnings.warn(f"{what}: cuDNN path unavailable ({reason}); using the XLA path", stacklevel=3)


def _prefill_xla(q, k, v, lengths, scale):
    # Prompts are right-padded, so plain causal attention never lets a valid row see padding keys;
    # rows past lengths[b] are padding and may hold any finite value. XLA's fused causal attention
    # (float32 logits) runs a 5k-token prefill ~3x faster on CPU than a materialised [T, S] mask.
    del lengths
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, implementation="xla")


def _prefill_cudnn(q, k, v, lengths, scale):
    reason = _cudnn_unusable(q)
    if reason is not None:
        _fallback_warning("prefill_attention", reason)
        return _prefill_xla(q, k, v, lengths, scale)
    lengths = lengths.astype(jnp.int32)
    # is_causal is top-left aligned, which is right here: queries and keys are the same positions.
    o = jax.nn.dot_product_attention(
        q,
        k,
        v,
        scale=scale,
        is_causal=True,
        query_seq_lengths=lengths,
        key_value_seq_lengths=lengths,
        implementation="cudnn",
    )
    # Padding rows (and every row of an empty sequence) come back as 0, never as cuDNN's leftovers.
    valid = jnp.arange(q.shape[1])[None, :] < lengths[:, None]
    return jnp.where(valid[:, :, None, None], o, 0).astype(q.dtype)


def prefill_attention(q, k, v, lengths, *, impl: str = "xla", scale=None):
    """Causal self-attention of a block of L tokens: q [B,L,Hq,D], k/v [B,L,Hkv,D], lengths int32[B].

    Query i sees keys j <= i with j < lengths[b]; rows past lengths[b] are padding (any finite value).
    There is no Pallas prefill kernel: impl "pallas" runs the cuDNN path, which (like "cudnn") falls
    back to XLA off GPU or for float32 inputs.
    """
    _check_impl(impl, "prefill_attention")
    if impl == "xla":
        return _prefill_xla(q, k, v, lengths, scale)
    return _prefill_cudnn(q, k, v, lengths, scale)


def _cache_mask(cache_len, num_queries: int, capacity: int):
    visible = jnp.arange(capacity)[None, None, :] < cache_len[:, None, None]
    return jnp.broadcast_to(visible, (cache_len.shape[0], num_queries, capacity))


def _cache_xla(q, k_cache, v_cache, cache_len, scale):
    return masked_softmax_attention(
        q, k_cache, v_cache, _cache_mask(cache_len, q.shape[1], k_cache.shape[1]), scale=scale
    )


def _cache_cudnn(q, k_cache, v_cache, cache_len, scale):
    """cuDNN flash with a padding mask; the float32 LSE comes from JAX's private cuDNN entry point
    (the public return_residual LSE is rounded to bf16, too coarse to merge). Pinned to jax 0.11:
    keywords only, and any refusal at trace time falls back to XLA."""
    reason = _cudnn_unusable(q)
    if reason is None:
        b, t = q.shape[:2]
        cache_len = jnp.minimum(cache_len.astype(jnp.int32), k_cache.shape[1])
        try:
            from jax._src.cudnn import fused_attention_stablehlo as cudnn_fa

            o, lse = cudnn_fa.dot_product_attention(
                query=q,
                key=k_cache,
                value=v_cache,
                q_seqlen=jnp.full((b,), t, jnp.int32),
                kv_seqlen=cache_len,
                scale=q.shape[-1] ** -0.5 if scale is None else scale,
                mask_type=cudnn_fa.MaskType.PADDING,
                qkv_layout="BTNH",
                return_residual=True,
            )
        except (ImportError, AttributeError, TypeError, ValueError, NotImplementedError, RuntimeError) as err:
            reason = f"{type(err).__name__}: {err}"
        else:
            # An empty cache must read as "no keys" (o = 0, lse = -inf) whatever cuDNN returns for it.
            empty = cache_len == 0
            o = jnp.where(empty[:, None, None, None], 0, o).astype(q.dtype)
            lse = jnp.where(empty[:, None, None], -jnp.inf, lse.astype(jnp.float32))
            return o, lse
    _fallback_warning("cache_attention", reason)
    return _cache_xla(q, k_cache, v_cache, cache_len, scale)


def cache_attention(q, k_cache, v_cache, cache_len, *, impl: str = "xla", scale=None):
    """q [B,T,Hq,D] against keys [0, cache_len[b]) of k_cache, v_cache [B,S,Hkv,D], no mask.

    Returns (o [B,T,Hq,D] in q.dtype, lse float32 [B,Hq,T]); an empty cache gives o = 0, lse = -inf.
    """
    _check_impl(impl, "cache_attention")
    if impl == "pallas":
        return _kernel(pallas_cache.cache_attention, q, k_cache, v_cache, cache_len, scale=scale)
    if impl == "cudnn":
        return _cache_cudnn(q, k_cache, v_cache, cache_len, scale)
    return _cache_xla(q, k_cache, v_cache, cache_len, scale)


def merge_attention(o_c, lse_c, o_s, lse_s):
    """Exact combination of attention over two disjoint key sets, each given as (o [B,T,Hq,D],
    lse float32 [B,Hq,T]): LSE = logaddexp(lse_c, lse_s), O = O_c e^(lse_c - LSE) + O_s e^(lse_s - LSE),
    in float32. A side with lse = -inf (no visible key) gets weight 0; both empty gives 0."""
    lse = jnp.logaddexp(lse_c, lse_s)
    shift = jnp.where(lse == -jnp.inf, 0.0, lse)

    def weight(side_lse):  # [B, Hq, T] -> [B, T, Hq, 1]
        return jnp.exp(side_lse - shift).transpose(0, 2, 1)[..., None]

    o = o_c.astype(jnp.float32) * weight(lse_c) + o_s.astype(jnp.float32) * weight(lse_s)
    return o.astype(o_c.dtype)


def _hybrid_xla(q, k_cache, v_cache, cache_len, k_new, v_new, tree_mask, scale):
    """Dense XLA attention over the cache and over the new keys, merged by LSE. Concatenating the
    keys instead would copy the whole cache every step (1.6x slower per layer on CPU at 8k rows)."""
    o_c, lse_c = _cache_xla(q, k_cache, v_cache, cache_len, scale)
    o_s, lse_s = masked_softmax_attention(
        q, k_new.astype(k_cache.dtype), v_new.astype(v_cache.dtype), tree_mask, scale=scale
    )
    return merge_attention(o_c, lse_c, o_s, lse_s)


def hybrid_tree_attention(q, k_cache, v_cache, cache_len, k_new, v_new, tree_mask, *, impl: str = "xla", scale=None):
    """q [B,T,Hq,D] against cache keys [0, cache_len[b]) of k_cache/v_cache [B,S,Hkv,D] (no mask)
    plus new keys k_new/v_new [B,T',Hkv,D] under tree_mask bool[B,T,T']. Returns o [B,T,Hq,D].

    "pallas": the fused Pallas kernel (split-K over the cache with the new keys as one more split,
    then a Pallas combine: two kernels). "cudnn": cuDNN over the cache, the Pallas masked kernel
    over the new keys, merged by LSE.
    """
    _check_impl(impl, "hybrid_tree_attention")
    if impl == "xla":
        return _hybrid_xla(q, k_cache, v_cache, cache_len, k_new, v_new, tree_mask, scale)
    if impl == "pallas":
        return _kernel(
            pallas_hybrid.hybrid_attention,
            q,
            k_cache,
            v_cache,
            cache_len,
            k_new.astype(k_cache.dtype),
            v_new.astype(v_cache.dtype),
            tree_mask,
            scale=scale,
        )
    o_c, lse_c = cache_attention(q, k_cache, v_cache, cache_len, impl="cudnn", scale=scale)
    o_s, lse_s = masked_attention(q, k_new.astype(q.dtype), v_new.astype(q.dtype), tree_mask, scale=scale)
    return merge_attention(o_c, lse_c, o_s, lse_s).astype(q.dtype)


def sliding_window_attention(q, k, v, window: int, *, impl: str = "xla"):
    """Causal self-attention where query i sees keys [i - window, i] (by index): the draft's
    training self-attention. q [B,L,Hq,D], k/v [B,L,Hkv,D] -> o [B,L,Hq,D].

    impl "cudnn" / "pallas" on GPU with bf16/f16 inputs: cuDNN flash attention with a (window, 0)
    local window. Otherwise XLA in chunks of C = min(window, L) queries, each against its own and
    the previous chunk's keys (which hold its whole window): memory O(L * 2C), not O(L^2)."""
    _check_impl(impl, "sliding_window_attention")
    if impl != "xla" and _cudnn_unusable(q) is None:
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
    o, _ = masked_softmax_attention(
        qc.reshape(b * n, c, hq, d), kk.reshape(b * n, 2 * c, hkv, d), vv.reshape(b * n, 2 * c, hkv, d), mask
    )
    return o.reshape(b, n * c, hq, d)[:, :l]


def attend_and_write_slots(
    qkv, inv_freq, k_slots, v_slots, slot_positions, mask, write_slots, positions, *, num_heads: int
):
    """The draft's inference self-attention: a block of T tokens against its fixed buffer of key
    slots (ring and tree slots) and against itself, then written there.

    qkv [B,T,(Hq + 2 Hkv) * D]: the tokens' q|k|v product before RoPE, rotated at positions
    int32[B,T] by the rates inv_freq float32[D/2] (`rope.inverse_frequencies`). The rotated q
    attends k_slots/v_slots [B,S,Hkv,D] (keys after RoPE), then the block's own keys, where mask
    bool[B,T,S + T] is True (slots' columns first). After every slot is read, token t's rotated
    key, value and position go to slot write_slots[b, t] (S or more: not written). Returns
    (o [B,T,Hq,D] in qkv.dtype, k_slots, v_slots, slot_positions); 0 where a row sees nothing. S is
    a window plus a tree, whatever the context length.

    XLA's ops: RoPE, dense attention over the concatenated keys, then three scatters ordered after
    it. (One Pallas kernel for all of it, timed on the H200, took 22-58 us a call where XLA's
    dozen kernels take ~25 us: BENCHMARKS.md.)"""
    b, t, width = qkv.shape
    hkv, d = k_slots.shape[2], k_slots.shape[3]
    qkv = qkv.reshape(b, t, width // d, d).astype(k_slots.dtype)
    cos, sin = rope_tables(positions, inv_freq)
    q = rotate(qkv[:, :, :num_heads], cos, sin)
    k = rotate(qkv[:, :, num_heads : num_heads + hkv], cos, sin)
    v = qkv[:, :, num_heads + hkv :]
    keys = jnp.concatenate([k_slots, k], axis=1)
    values = jnp.concatenate([v_slots, v], axis=1)
    o = masked_softmax_attention(q, keys, values, mask)[0]
    # The writes below come after every read of the buffer: XLA then updates it in place. Without
    # the order it copies the buffer before each write where it cannot tell (a decode loop nested
    # in mode auto's branches).
    o, (k_slots, v_slots, slot_positions) = jax.lax.optimization_barrier((o, (k_slots, v_slots, slot_positions)))
    put = lambda buf, new: write_at_slots(buf, write_slots, new)
    return o, put(k_slots, k), put(v_slots, v), put(slot_positions, positions)


def write_at_slots(buf: jax.Array, slots: jax.Array, new: jax.Array) -> jax.Array:
    """buf [B,S,...] with new [B,T,...] written at slots int32[B,T] (row t of sequence b to slot
    slots[b, t]); slots outside [0, S) are dropped."""
    rows = jnp.arange(buf.shape[0])[:, None]
    return buf.at[rows, slots].set(new.astype(buf.dtype), mode="drop")


# The hybrid impl with the lowest measured time at the verify shapes on an H200 (BENCHMARKS.md,
# "Hybrid tree attention").
FASTEST_GPU_IMPL = "pallas"


def default_impl() -> str:
    """The attention implementation for the default backend: the fastest measured on GPU, xla elsewhere."""
    return FASTEST_GPU_IMPL if jax.default_backend() == "gpu" else "xla"


def _decode_cudnn(q, k_cache, v_cache, lengths, scale):
    reason = _cudnn_unusable(q)
    if reason is not None:
        _fallback_warning("decode_attention", reason)
        return _cache_xla(q, k_cache, v_cache, lengths, scale)[0]
    lengths = jnp.minimum(lengths.astype(jnp.int32), k_cache.shape[1])
    # No residual needed here, so the public entry point serves (one cuDNN kernel, GQA native).
    o = jax.nn.dot_product_attention(
        q, k_cache, v_cache, scale=scale, key_value_seq_lengths=lengths, implementation="cudnn"
    )
    return jnp.where((lengths == 0)[:, None, None, None], 0, o).astype(q.dtype)


def decode_attention(q, k_cache, v_cache, lengths, *, impl: str = "xla", scale=None):
    """One new query per sequence against cache rows [0, lengths[b]) of k_cache/v_cache [B,S,Hkv,D],
    the new token's own K/V already written there (AR decoding): one attention, no mask, no LSE
    merge. q [B,1,Hq,D] -> o [B,1,Hq,D] in q.dtype; lengths[b] = 0 gives o = 0.

    "pallas" runs the split-K cache kernel; "cudnn" cuDNN flash (XLA off GPU or for float32)."""
    _check_impl(impl, "decode_attention")
    if q.shape[1] != 1:
        raise UserError(f"decode_attention takes one query per sequence, got {q.shape[1]}: use hybrid_tree_attention")
    if impl == "pallas":
        return pallas_cache.cache_attention(q, k_cache, v_cache, lengths, scale=scale)[0]
    if impl == "cudnn":
        return _decode_cudnn(q, k_cache, v_cache, lengths, scale)
    return _cache_xla(q, k_cache, v_cache, lengths, scale)[0]


def write_cache_rows(cache_rows: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """cache_rows [B,S,H,D] with new [B,T,H,D] written at rows [start[b], start[b] + T).

    The caller keeps start + T <= S (dynamic_update_slice would clamp the start, not fail). At
    batch 1 a plain dynamic_update_slice: batched, it becomes a scatter whose bounds check reads
    every written row first, one more kernel per cache array on the GPU."""
    new = new.astype(cache_rows.dtype)
    if cache_rows.shape[0] == 1:
        return jax.lax.dynamic_update_slice(cache_rows, new, (0, start[0], 0, 0))
    write = lambda c, n, s: jax.lax.dynamic_update_slice(c, n, (s, 0, 0))
    return jax.vmap(write)(cache_rows, new, start)


def on_hopper() -> bool:
    """Whether the kernels run compiled on a Hopper GPU (compute capability 9.x: wgmma and TMA): the
    default device's (`jax.default_device`, as the kernel counter compiles for a GPU it lacks), else
    the first device."""
    if flash_block.default_interpret():
        return False
    device = jax.config.jax_default_device or jax.devices()[0]
    return str(getattr(device, "compute_capability", "")).startswith("9")


def cache_on_hopper_units(num_tokens: int, num_heads: int, k_cache, *, on_hopper: bool) -> bool:
    """Whether a verified block's attention runs on the Mosaic GPU kernel (`cache_attention_mgpu`)
    instead of the Triton hybrid kernel: on a Hopper GPU, for a 64-token block, a 16-bit cache of
    whole 128-row tiles, a head dim a power of two and a multiple of 64, and blocks that fill the
    GPU in one wave or better: query heads that pair up on a KV head (an even group: Llama-3's GQA),
    or, at head dim 128, one head a block where the batch's heads are no more than the GPU's SMs
    (MHA's and odd groups' blocks come in whole waves of slices only up to there: QwQ-32B's 40 heads
    at batch 4 ran slower here than on the Triton kernel). A small model's verified layer (SmolLM2:
    head dim 64, a group of 3) is bound by how many kernels it runs, and this route runs one more
    than the fused Triton kernel. BENCHMARKS.md, "The verify's cache half on Hopper's units" and
    "The Hopper route for MHA and odd groups"."""
    batch, _, num_kv_heads, head_dim = k_cache.shape
    pairs = (num_heads // num_kv_heads) % 2 == 0
    one_wave_of_heads = head_dim >= 128 and batch * num_heads <= flash_block.NUM_SMS
    return (
        on_hopper
        and num_tokens == mgpu_cache.QUERY_ROWS
        and k_cache.dtype in (jnp.bfloat16, jnp.float16)
        and head_dim % 64 == 0
        and pallas_rotate.supports(head_dim)
        and k_cache.shape[1] % CACHE_ROW_TILE == 0
        and (pairs or one_wave_of_heads)
    )


def _verify_on_hopper_units(packed, self_mask, num_heads, scale):
    """attend_and_write_block's verify on the Mosaic GPU kernel: a Triton kernel rotates q and the new
    keys and writes the block's K/V rows; the Mosaic GPU kernel attends cache rows [0, lengths[b]) and,
    under self_mask, the rows just written; split_combine merges its slices. packed: the fused
    kernel's first operands (qkv, cos, sin, k_cache, v_cache, lengths)."""
    q, k_cache, v_cache = _kernel(pallas_rotate.rotate_and_write, *packed, num_heads=num_heads)
    lengths = packed[-1]
    o, _ = _kernel(mgpu_cache.cache_attention, q, k_cache, v_cache, lengths, block_mask=self_mask, scale=scale)
    return o, k_cache, v_cache


def _rotate_and_write(qkv, cos, sin, k_cache, v_cache, lengths, num_heads: int):
    """XLA's share of attend_and_write_block outside the fused kernel: (rotated q, the caches with
    the block's rotated k and its v written at rows [lengths[b], lengths[b] + T))."""
    hkv = k_cache.shape[2]
    # q and k rotated together: one elementwise op, the same result (the rotation is per head).
    qk = rotate(qkv[:, :, : num_heads + hkv], cos, sin)
    k_cache = write_cache_rows(k_cache, qk[:, :, num_heads:], lengths)
    v_cache = write_cache_rows(v_cache, qkv[:, :, num_heads + hkv :], lengths)
    return qk[:, :, :num_heads], k_cache, v_cache


def attend_and_write_block(
    qkv, rope, k_cache, v_cache, lengths, self_mask, *, num_heads: int, impl: str = "xla", scale=None
):
    """The attention of a block of new tokens (AR decoding's one token; under "pallas" a verified
    tree too), from the model's q|k|v product, their K/V written into the cache.

    qkv [B,T,(Hq + 2 Hkv) * D]: q, k and v of the tokens before RoPE; rope: `rope.rope_tables`'
    (cos, sin) at their positions. The rotated q attends cache rows [0, lengths[b]) of
    k_cache/v_cache [B,S,Hkv,D] plus the block's own keys where self_mask bool[B,T,T] is True, and
    the rotated k and v go to rows [lengths[b], lengths[b] + T) (the caller keeps lengths + T <= S).
    Returns (o [B,T,Hq,D] in qkv.dtype, k_cache, v_cache). T > 1 (a verified tree) needs "pallas".

    "pallas": one fused kernel rotates, attends and writes the rows (the caches are its outputs,
    aliased to its inputs), then the Pallas combine: no slice, rotation or cache-write kernels. A
    64-token verify on a Hopper GPU instead runs on the Mosaic GPU kernel, the tree's own keys
    included (`cache_on_hopper_units`).
    "xla" / "cudnn" (T = 1) split and rotate, write the row, then attend rows
    [0, lengths[b] + self_mask[b]) (`decode_attention`)."""
    _check_impl(impl, "attend_and_write_block")
    b, t, width = qkv.shape
    d = k_cache.shape[3]
    if t != 1 and impl != "pallas":
        raise UserError(
            f"attend_and_write_block takes one token per sequence under impl {impl!r}, got {t}: "
            "use hybrid_tree_attention"
        )
    qkv = qkv.reshape(b, t, width // d, d)
    cos, sin = rope
    if impl == "pallas":
        packed = (
            qkv.astype(k_cache.dtype),
            cos.reshape(b, t, d // 2),
            sin.reshape(b, t, d // 2),
            k_cache,
            v_cache,
            lengths,
        )
        if cache_on_hopper_units(t, num_heads, k_cache, on_hopper=on_hopper()):
            return _verify_on_hopper_units(packed, self_mask, num_heads, scale)
        return _kernel(pallas_hybrid.hybrid_attention_and_write, *packed, self_mask, num_heads=num_heads, scale=scale)
    q, k_cache, v_cache = _rotate_and_write(qkv, cos, sin, k_cache, v_cache, lengths, num_heads)
    visible = lengths + self_mask[:, 0, 0].astype(jnp.int32)
    return decode_attention(q, k_cache, v_cache, visible, impl=impl, scale=scale), k_cache, v_cache
