"""The training step sharded over 4 fake CPU devices (2x2 meshes) == the same step on one device.

The device count is fixed when JAX starts, so the comparison runs in a subprocess (this file run as
a script with XLA_FLAGS=--xla_force_host_platform_device_count=4) that prints its results as JSON.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
MESHES = {"single": (1, 1, 1), "data2_fsdp2": (2, 2, 1), "fsdp2_tensor2": (1, 2, 2)}
STEPS = 3  # the first step's learning rate is 0 (warmup), so two real updates follow


def worker() -> None:
    import jax
    from flax import nnx

    from longspec_jax.draft_io import init_draft
    from longspec_jax.target import random_target
    from train import sharding
    from train.config import load_config
    from train.optim import make_optimizer
    from train.step import compile_step, init_state, step_config

    assert jax.device_count() == 4
    cfg = load_config("tiny")
    target = random_target(cfg.model, seed=0, dtype="float32")
    draft = init_draft(target, 1)
    optimizer, _ = make_optimizer(cfg, total_steps=10)
    rng = np.random.default_rng(0)
    # [accumulation 2, sequences 4, length 32]; about a fifth of the labels masked out.
    batches = [
        {
            "tokens": rng.integers(0, 257, (2, 4, 32), dtype=np.int32),
            "loss_mask": (rng.random((2, 4, 32)) > 0.2).astype(np.int32),
        }
        for _ in range(STEPS)
    ]
    out = {}
    for name, shape in MESHES.items():
        devices = jax.devices()[: int(np.prod(shape))]
        mesh = sharding.make_mesh(shape, devices)
        target_graphdef, target_params = nnx.split(target.model)
        # min_elements=0: shard even these tiny arrays, so the test exercises real partitioning.
        target_params = jax.device_put(target_params, sharding.param_shardings(target_params, mesh, min_elements=0))
        draft_graphdef, draft_params = nnx.split(draft.block)
        state = init_state(nnx.to_pure_dict(draft_params), optimizer, mesh, min_elements=0)
        step = compile_step(target_graphdef, draft_graphdef, optimizer, step_config(cfg), mesh, target_params, state)
        losses = []
        for i, batch in enumerate(batches):
            state, metrics = step(target_params, state, sharding.global_batch(batch, mesh), jax.random.key(i))
            losses.append(float(metrics["loss"]))
        embed = target_params["embed"][...]
        kernel = state["params"]["mlp"]["up_proj"]["kernel"]
        out[name] = {
            "losses": losses,
            "params": {
                jax.tree_util.keystr(k): np.asarray(v).tolist()
                for k, v in jax.tree_util.tree_flatten_with_path(state["params"])[0]
            },
            "embed_shard_rows": embed.addressable_shards[0].data.shape[0],
            "draft_kernel_shard": list(kernel.addressable_shards[0].data.shape),
            "draft_kernel_spec": str(kernel.sharding.spec),
        }
    print(json.dumps(out))


@pytest.fixture(scope="module")
def results():
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
        "PYTHONPATH": str(REPO),
    }
    proc = subprocess.run([sys.executable, __file__], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_arrays_are_really_partitioned(results):
    vocab = 320
    assert results["single"]["embed_shard_rows"] == vocab
    assert results["data2_fsdp2"]["embed_shard_rows"] == vocab // 2  # the target is split over fsdp
    assert (
        "fsdp" in results["fsdp2_tensor2"]["draft_kernel_spec"]
        and "tensor" in results["fsdp2_tensor2"]["draft_kernel_spec"]
    )
    assert np.prod(results["fsdp2_tensor2"]["draft_kernel_shard"]) * 4 == np.prod(
        results["single"]["draft_kernel_shard"]
    )


@pytest.mark.parametrize("mesh", ["data2_fsdp2", "fsdp2_tensor2"])
def test_sharded_steps_equal_the_single_device_steps(results, mesh):
    single, sharded = results["single"], results[mesh]
    np.testing.assert_allclose(sharded["losses"], single["losses"], rtol=1e-5)
    assert single["losses"][0] != single["losses"][-1]  # the steps did update the draft
    assert sharded["params"].keys() == single["params"].keys()
    for name, value in single["params"].items():
        np.testing.assert_allclose(
            np.asarray(sharded["params"][name]), np.asarray(value), rtol=1e-4, atol=2e-6, err_msg=name
        )


if __name__ == "__main__":
    worker()
