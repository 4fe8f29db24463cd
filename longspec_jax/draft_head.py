"""The LM head a draft ranks its candidates under: which tokens (its candidate vocabulary, or all of
them) and in what form (the target's rows, or int8 rows with a float32 scale a row).

A draft level reads the head once for its few rows, five times a round: Llama-3's 128,256 x 4,096
head is 1.05 GB in bfloat16, ~2 of an H100's 11.8 ms round at 32k (BENCHMARKS.md, "Where a Llama-3-8B
round's time goes"). The candidates need not be exact for the output to be (the target's check
decides every token), so a large head is read as int8 (`HEAD_FORMATS`, "auto": from
`int8_rows.INT8_MIN_BYTES`): each row symmetric, scale = max |row| / 127, half the bytes of
bfloat16. The draft's own distribution, where a drawn chain's acceptance test needs it, comes
from the same int8 rows (`DraftHead.logits`), so it is the distribution the draft drew from and
sampling stays exact. Greedy output and the sampling distribution stay the target's; what the rounding costs is
rounds where it moves a candidate out of a level's top k.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from longspec_jax.errors import UserError
from longspec_jax.int8_rows import quantized_rows, takes_int8
from pallas_kernels.head_top_k import head_top_k

# "auto": the target's rows for a head under int8_rows.INT8_MIN_BYTES (in the target's dtype), else
# int8. SmolLM2's cut head (16,400 x 576, bfloat16: 19 MB) stays as it is; a 7B's (Vicuna-7B 0.26 GB,
# Llama-3-8B 1.05 GB) is read as int8.
HEAD_FORMATS = ("auto", "int8", "target")


@struct.dataclass
class DraftHead:
    """rows [C, H]: the target's LM head rows (its dtype), or int8 with scale float32[C] (row c is
    rows[c] * scale[c]); ids int32[C] ascending: the tokens of the rows (None: every token, row =
    token id)."""

    rows: jax.Array
    scale: jax.Array | None
    ids: jax.Array | None

    def logits(self, features: jax.Array) -> jax.Array:
        """float32[..., C] of features [..., H] against the rows (in the features' dtype, float32 sums)."""
        rows = self.rows if self.scale is None else self.rows.astype(features.dtype)
        logits = jnp.einsum("...h,vh->...v", features.astype(rows.dtype), rows, preferred_element_type=jnp.float32)
        return logits if self.scale is None else logits * self.scale

    def full_logits(self, logits: jax.Array, vocab_size: int) -> jax.Array:
        """Logits [..., C] of the rows -> float32[..., vocab_size], -inf at tokens without a row (a
        distribution over the candidates alone once softmaxed)."""
        if self.ids is None:
            return logits.astype(jnp.float32)
        full = jnp.full(logits.shape[:-1] + (vocab_size,), -jnp.inf, jnp.float32)
        return full.at[..., self.ids].set(logits.astype(jnp.float32))

    def top_k(self, features: jax.Array, k: int, noise: jax.Array | None = None):
        """`head_top_k` over the rows for features [R, H] (noise float32[G, V] over the whole
        vocabulary, or None) -> (values float32[R, k], token ids int32[R, k])."""
        if self.ids is not None and noise is not None:
            noise = jnp.take(noise, self.ids, axis=1)
        rows_dtype = self.rows.dtype if self.scale is None else features.dtype
        best, ids = head_top_k(features.astype(rows_dtype), self.rows, k, head_scale=self.scale, noise=noise)
        return best, (ids if self.ids is None else jnp.take(self.ids, ids))


def check_head_format(head_format: str) -> str:
    """head_format if it is one of HEAD_FORMATS, else a UserError naming them."""
    if head_format not in HEAD_FORMATS:
        raise UserError(f"unknown draft head format {head_format!r}: choose one of {', '.join(HEAD_FORMATS)}")
    return head_format


def reads_int8(head_format: str, rows: int, hidden: int, dtype) -> bool:
    """Whether a draft's head of `rows` rows of `hidden` features in `dtype` is read as int8."""
    return takes_int8(check_head_format(head_format), rows * hidden * jnp.dtype(dtype).itemsize)


def draft_head(target_model, ids=None, head_format: str = "auto") -> DraftHead | None:
    """The head a draft with candidate token `ids` (None: all) ranks under, for `target_model` (a
    `Transformer`: its lm_head, or its tied embedding); None where that is the target's head as it
    is (no cut, not int8)."""
    head = target_model.embed[...] if target_model.lm_head is None else target_model.lm_head[...]
    ids = None if ids is None else jnp.asarray(ids, jnp.int32)
    rows = head if ids is None else jnp.take(head, ids, axis=0)
    if not reads_int8(head_format, rows.shape[0], rows.shape[1], rows.dtype):
        return None if ids is None else DraftHead(rows, None, ids)
    return DraftHead(*quantized_rows(rows), ids)
