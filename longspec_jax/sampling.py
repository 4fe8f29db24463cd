"""Sampling rules: temperature, top-k and top-p as one exact transform of logits, plus the picks.

`filtered_log_probs` returns the log-probabilities of the distribution a token is actually drawn
from. AR decoding samples from it, and speculative acceptance (acceptance.py) samples from the same
function at every tree node, which is what makes sampled speculative output exactly distributed as
AR output. The rules, applied in this order to float32 logits [..., V]:

1. temperature T > 0: logits / T.  T == 0 means greedy: the distribution is the point mass on
   `greedy_pick` (argmax; ties go to the lowest token id), whatever top-k / top-p say.
2. top-k (k > 0): keep every token whose scaled logit is >= the k-th largest one. Tokens tied with
   the k-th value are all kept, so the kept set never depends on sort order (it can exceed k only
   through exact ties). k >= V keeps everything.
3. top-p (p < 1): on the probabilities after step 2, keep the smallest set of most likely tokens
   whose mass is >= p, plus every token tied with the least likely kept one (same reason). The most
   likely token is always kept.

The kept logits are renormalised (log-softmax); removed tokens get -inf.

Picks (`pick_token`) are Gumbel-max draws: argmax(kept logits / T + Gumbel noise), an exact sample
of that distribution, and with the noise switched off by the traced `greedy` flag (T = 1 then) the
argmax itself, i.e. the greedy point mass. So greedy and sampling are ONE compiled program: the
settings are arrays, and only two static flags pick the program: top-k filtering on (top_k > 0)
and top-p filtering on (top_p < 1), each a sort over the vocabulary that a program without it does
not pay. Changing temperature (greedy included), the seed, or the values of top-k / top-p while
they stay on does not recompile; turning top-k or top-p on or off does.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp
from flax import struct

from longspec_jax.errors import UserError

INT32_MAX = 2**31 - 1


@struct.dataclass
class SamplingParams:
    """Sampling settings as a pytree: temperature float32[] (1 when greedy), top_k int32[],
    top_p float32[], greedy bool[] are arrays; use_top_k / use_top_p are static."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    greedy: jax.Array
    use_top_k: bool = struct.field(pytree_node=False)
    use_top_p: bool = struct.field(pytree_node=False)

    @classmethod
    def create(cls, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0) -> SamplingParams:
        """Validated settings; temperature 0 = greedy, top_k 0 = off, top_p 1 = off."""
        return SamplingSettings.checked(temperature, top_k, top_p).params()


@dataclasses.dataclass(frozen=True)
class SamplingSettings:
    """A request's sampling settings as Python values (`checked` validates them): what the host
    reads (greedy or not, the keys of what earlier requests kept) without a round trip to the
    device. `params()` gives the arrays the loop reads."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    @classmethod
    def checked(cls, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0) -> SamplingSettings:
        try:
            temperature, top_p = float(temperature), float(top_p)
        except (TypeError, ValueError):
            raise UserError(f"temperature and top_p must be numbers, got {temperature!r} and {top_p!r}") from None
        if not math.isfinite(temperature) or temperature < 0:
            raise UserError(f"temperature must be a number >= 0 (0 = greedy), got {temperature}")
        if not isinstance(top_k, numbers.Real) or int(top_k) != top_k or not 0 <= top_k <= INT32_MAX:
            raise UserError(f"top_k must be an integer in [0, {INT32_MAX}] (0 = off), got {top_k}")
        if not 0.0 < top_p <= 1.0:
            raise UserError(f"top_p must be in (0, 1] (1 = off), got {top_p}")
        return cls(temperature, int(top_k), top_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def params(self) -> SamplingParams:
        return SamplingParams(
            temperature=jnp.asarray(1.0 if self.greedy else self.temperature, jnp.float32),
            top_k=jnp.asarray(self.top_k, jnp.int32),
            top_p=jnp.asarray(self.top_p, jnp.float32),
            greedy=jnp.asarray(self.greedy),
            use_top_k=self.top_k > 0,
            use_top_p=self.top_p < 1.0,
        )


def top_k_filter(logits: jax.Array, k) -> jax.Array:
    """logits [..., V] with every token below the k-th largest set to -inf (ties with it kept).
    k: int or int32 scalar array; k <= 0 keeps everything."""
    vocab = logits.shape[-1]
    k = jnp.asarray(k, jnp.int32)
    descending = -jnp.sort(-logits, axis=-1)
    kth = jnp.take(descending, jnp.clip(k - 1, 0, vocab - 1), axis=-1)[..., None]
    keep = (logits >= kth) | (k <= 0)
    return jnp.where(keep, logits, -jnp.inf)


def top_p_filter(logits: jax.Array, p) -> jax.Array:
    """logits [..., V] reduced to the smallest most-likely set with probability mass >= p (plus ties
    with its least likely member); others -inf. p: float or float32 scalar array in (0, 1]."""
    probs = jax.nn.softmax(logits, axis=-1)
    descending = -jnp.sort(-probs, axis=-1)
    mass_before = jnp.cumsum(descending, axis=-1) - descending
    # Position i (in descending order) is needed while the mass of the ones before it is < p.
    n_keep = jnp.maximum(jnp.sum(mass_before < p, axis=-1, keepdims=True), 1)
    threshold = jnp.take_along_axis(descending, n_keep - 1, axis=-1)
    return jnp.where(probs >= threshold, logits, -jnp.inf)


def filtered_logits(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """float32 logits [..., V] / temperature with the tokens top-k / top-p remove at -inf: the
    sampled distribution up to normalisation (module doc; greedy: temperature 1)."""
    scaled = logits.astype(jnp.float32) / params.temperature
    if params.use_top_k:
        scaled = top_k_filter(scaled, params.top_k)
    if params.use_top_p:
        scaled = top_p_filter(scaled, params.top_p)
    return scaled


def filtered_log_probs(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """float32 log-probabilities [..., V] of the distribution tokens are drawn from (module doc):
    the point mass on the argmax when greedy."""
    point_mass = jnp.where(jax.nn.one_hot(greedy_pick(logits), logits.shape[-1], dtype=bool), 0.0, -jnp.inf)
    return jnp.where(params.greedy, point_mass, jax.nn.log_softmax(filtered_logits(logits, params), axis=-1))


def greedy_pick(logits: jax.Array) -> jax.Array:
    """int32 argmax over the last axis; ties go to the lowest token id."""
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def sample(key: jax.Array, log_probs: jax.Array) -> jax.Array:
    """One int32 token per row of log_probs [..., V] (rows are drawn independently)."""
    return jax.random.categorical(key, log_probs, axis=-1).astype(jnp.int32)


def pick_token(key: jax.Array, logits: jax.Array, params: SamplingParams) -> jax.Array:
    """The next token for each row of logits [..., V], rows drawn independently: the argmax when
    greedy (the key is then unused), else a sample from `filtered_log_probs`. One program for
    both: the Gumbel noise that makes argmax a sample is zeroed when greedy, and the greedy
    logits are unscaled, so the argmax is exactly `greedy_pick`'s."""
    return pick_with_noise(logits, jax.random.gumbel(key, logits.shape, jnp.float32), params)


def pick_with_noise(logits: jax.Array, noise: jax.Array, params: SamplingParams) -> jax.Array:
    """`pick_token` with the Gumbel noise given, float32 broadcastable to logits [..., V]: the
    argmax of the filtered logits plus the noise (the noise ignored when greedy). Rows that share
    noise are coupled, each still an exact sample of its own distribution."""
    return greedy_pick(filtered_logits(logits, params) + jnp.where(params.greedy, 0.0, noise))


def gumbel_noise(key: jax.Array, shape: tuple[int, ...], params: SamplingParams) -> jax.Array:
    """float32 standard Gumbel noise of `shape`, zeros when greedy."""
    return jnp.where(params.greedy, 0.0, jax.random.gumbel(key, shape, jnp.float32))
