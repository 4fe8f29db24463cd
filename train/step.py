"""One optimiser step of draft training, as a pure function jitted with explicit shardings.

Per micro-batch (a `lax.scan` over the accumulation axis): anchor-offset positions, the frozen
target's last-layer K/V (forward only, no gradient), the draft's training forward with one
flash-noisy lag j ~ U{1..gamma-1} for the whole step, and the chunked cross-entropy (with `distill`
> 0 also against the target's own next-token distribution: then the target's last layer runs whole
and its final features go to the loss, which makes their logits chunk by chunk). Gradients are
taken for the draft's parameters only, summed over micro-batches weighted by their label counts
(so the step's loss is the mean over every label of the batch), then clipped and applied by AdamW.

Master weights and optimiser state are float32; the draft computes in `compute_dtype` (a cast
inside the differentiated function, so gradients arrive in float32). The target's parameters are
arguments of the jitted function (never closed over: they would become program constants).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from longspec_jax import attention
from longspec_jax.anchor_offset import anchor_offset_positions_jax
from longspec_jax.draft import draft_loss
from train import sharding


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """The static part of a step (hashable: it shapes the program)."""

    gamma: int
    anchor_offset: bool
    num_anchors: int
    max_offset: int
    compute_dtype: str
    attn_impl: str  # resolved: never None
    loss_chunk_tokens: int
    distill: float = 0.0  # weight of the target's own distribution as the soft label


def step_config(cfg) -> StepConfig:
    s = cfg.current
    return StepConfig(
        gamma=cfg.gamma,
        anchor_offset=s.anchor_offset,
        num_anchors=cfg.num_anchors,
        max_offset=s.max_offset,
        compute_dtype=cfg.compute_dtype,
        attn_impl=cfg.attn_impl or attention.default_impl(),
        loss_chunk_tokens=cfg.loss_chunk_tokens,
        distill=cfg.distill,
    )


def _positions(key, batch: int, seq_len: int, sc: StepConfig) -> jax.Array:
    if sc.anchor_offset:
        return anchor_offset_positions_jax(key, seq_len, sc.max_offset, num_anchors=sc.num_anchors, batch=batch)
    return jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (batch, seq_len))


def _cast_floats(tree, dtype):
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def train_step(
    target_graphdef,
    draft_graphdef,
    optimizer: optax.GradientTransformation,
    sc: StepConfig,
    target_params,
    state: dict[str, Any],
    batch: dict[str, jax.Array],
    key: jax.Array,
):
    """state = {"params": float32 draft params, "opt": optimiser state};
    batch = {"tokens", "loss_mask"}: int32[A, B, L] (A micro-batches). Returns (state, metrics)."""
    target_model = nnx.merge(target_graphdef, target_params)
    params = state["params"]
    lag_key, pos_key = jax.random.split(key)
    lag = jax.random.randint(lag_key, (), 1, sc.gamma, dtype=jnp.int32)
    compute = jnp.dtype(sc.compute_dtype)

    def micro_loss(p, tokens, mask, positions, target_k, target_v, teacher):
        block = nnx.merge(draft_graphdef, _cast_floats(p, compute))
        return draft_loss(
            block,
            target_model,
            tokens,
            positions,
            mask,
            target_k,
            target_v,
            lag,
            attn_impl=sc.attn_impl,
            chunk_tokens=sc.loss_chunk_tokens,
            teacher=teacher,
            distill=sc.distill,
        )

    def micro(carry, xs):
        grad_sum, loss_sum, hit_sum, label_sum = carry
        tokens, mask, micro_key = xs
        mask = mask.astype(bool)
        positions = _positions(micro_key, tokens.shape[0], tokens.shape[1], sc)
        teacher = None
        if sc.distill > 0:  # the whole last layer too: its output is the target's distribution
            target_k, target_v, teacher = target_model.last_layer_kv(
                tokens, positions, attn_impl=sc.attn_impl, with_features=True
            )
        else:
            target_k, target_v = target_model.last_layer_kv(tokens, positions, attn_impl=sc.attn_impl)
        target_k, target_v, teacher = jax.lax.stop_gradient((target_k, target_v, teacher))
        (loss, metrics), grads = jax.value_and_grad(micro_loss, has_aux=True)(
            params, tokens, mask, positions, target_k, target_v, teacher
        )
        labels = metrics["tokens"].astype(jnp.float32)
        grad_sum = jax.tree.map(lambda a, g: a + g * labels, grad_sum, grads)
        return (grad_sum, loss_sum + loss * labels, hit_sum + metrics["accuracy"] * labels, label_sum + labels), None

    tokens, mask = batch["tokens"], batch["loss_mask"]
    micro_keys = jax.random.split(pos_key, tokens.shape[0])
    zeros = jax.tree.map(jnp.zeros_like, params)
    zero = jnp.zeros((), jnp.float32)
    (grad_sum, loss_sum, hit_sum, label_sum), _ = jax.lax.scan(
        micro, (zeros, zero, zero, zero), (tokens, mask, micro_keys)
    )
    denom = jnp.maximum(label_sum, 1.0)
    grads = jax.tree.map(lambda g: g / denom, grad_sum)
    updates, opt_state = optimizer.update(grads, state["opt"], params)
    new_params = optax.apply_updates(params, updates)
    metrics = {
        "loss": loss_sum / denom,
        "accuracy": hit_sum / denom,
        "grad_norm": optax.tree.norm(grads),
        "labels": label_sum,
        "lag": lag,
    }
    return {"params": new_params, "opt": opt_state}, metrics


def compile_step(target_graphdef, draft_graphdef, optimizer, sc: StepConfig, mesh, target_params, state):
    """`train_step` jitted with in/out shardings from the plan; the state's buffers are donated."""
    target_sh = jax.tree.map(lambda x: x.sharding, target_params)
    state_sh = jax.tree.map(lambda x: x.sharding, state)
    batch_sh = {"tokens": sharding.batch_sharding(mesh), "loss_mask": sharding.batch_sharding(mesh)}
    rep = sharding.replicated(mesh)
    fn = functools.partial(train_step, target_graphdef, draft_graphdef, optimizer, sc)
    return jax.jit(
        fn, in_shardings=(target_sh, state_sh, batch_sh, rep), out_shardings=(state_sh, rep), donate_argnums=(1,)
    )


def init_state(draft_params, optimizer, mesh, min_elements: int = sharding.REPLICATE_BELOW) -> dict[str, Any]:
    """float32 master params and optimiser state, placed by the sharding plan."""
    # Made by a jitted cast, so the buffers are new: the step donates the state's buffers, which
    # must not be the caller's draft module's arrays.
    shardings = sharding.param_shardings(draft_params, mesh, min_elements)
    params = jax.jit(lambda p: _cast_floats(p, jnp.float32), out_shardings=shardings)(draft_params)
    opt_shapes = jax.eval_shape(optimizer.init, params)
    opt = jax.jit(optimizer.init, out_shardings=sharding.param_shardings(opt_shapes, mesh, min_elements))(params)
    return {"params": params, "opt": opt}
