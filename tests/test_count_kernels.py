"""benchmarks/count_kernels.py builds the decode loop as Generator does and counts its kernels; on
the CPU it compiles for the CPU (the GPU description needs the CUDA plugin wheels)."""

import collections
import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest

from benchmarks import count_kernels
from benchmarks.decode_kernels import (
    SMALL_CONFIG,
    loop_body_kernel_list,
    loop_body_kernels,
    loop_body_kernels_by_op,
    while_loops,
)
from longspec_jax.adaptive import candidate_plan, lookup_tokens_of
from longspec_jax.draft import DraftConfig
from longspec_jax.draft_io import init_draft
from longspec_jax.model_shapes import MODEL_SHAPES
from longspec_jax.target import random_target


def test_loop_programs_compile_for_a_given_device_and_a_round_launches_more_than_a_step():
    target = random_target(SMALL_CONFIG, seed=0, dtype="float32")
    draft = init_draft(target, seed=1, config=DraftConfig(window=16)).cast(jnp.float32)
    cpu = jax.devices("cpu")[0]
    counts = {}
    for mode in ("ar", "longspec"):
        text = count_kernels.loop_program(
            target, draft, mode, 40, 8, "xla", cpu, widths=(2, 2) if mode != "ar" else None
        )
        assert " while(" in text
        counts[mode] = loop_body_kernels(text)
    assert 0 < counts["ar"] < counts["longspec"]


def test_a_lookup_chain_beside_the_tree_adds_its_search_to_the_round():
    target = random_target(SMALL_CONFIG, seed=0, dtype="float32")
    draft = init_draft(target, seed=1, config=DraftConfig(window=16)).cast(jnp.float32)
    cpu = jax.devices("cpu")[0]
    counts = [
        loop_body_kernels(
            count_kernels.loop_program(target, draft, "longspec", 40, 8, "xla", cpu, widths=(2, 2), lookup_tokens=n)
        )
        for n in (0, 3)
    ]
    assert counts[0] < counts[1]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_mode_auto_loop_holds_every_candidate(temperature):
    """Mode auto's loop branches to each candidate's round (batch 1, greedy: AR and the draft's deep
    tree with a lookup chain beside it; sampling: AR and a coupled tree): more kernels than its
    largest tree's round alone, whose kernels it holds, in an inner loop per candidate whose round
    launches a few more kernels than the tree's own loop (the policy's bookkeeping). The plan
    follows the temperature."""
    target = random_target(SMALL_CONFIG, seed=0, dtype="float32")
    draft = init_draft(target, seed=1, config=DraftConfig(window=16)).cast(jnp.float32)
    cpu = jax.devices("cpu")[0]
    plan = candidate_plan(True, temperature == 0.0, 1)
    name, widths = max(((name, w) for name, w in plan if name.startswith("tree")), key=lambda c: sum(c[1]))
    auto = count_kernels.loop_program(target, draft, "auto", 40, 8, "xla", cpu, temperature=temperature)
    # The same tree fixed, with the lookup chain auto's greedy plan puts beside it.
    chain = lookup_tokens_of(name)
    assert (chain > 0) == (temperature == 0.0)
    tree = count_kernels.loop_program(target, draft, "longspec", 40, 8, "xla", cpu, widths=widths, lookup_tokens=chain)
    assert " conditional(" in auto and " conditional(" not in tree
    assert loop_body_kernels(auto) > loop_body_kernels(tree)
    # One branch per candidate of the plan for this temperature (two at batch 1 either way).
    branches = re.search(r"branch_computations=\{([^}]*)\}", auto).group(1)
    assert branches.count("%") == len(plan)
    # The loop of runs holds the most kernels, the tree's loop of rounds the next most.
    *_, tree_round, _runs = sorted(kernels for _, _, kernels in while_loops(auto))
    fixed_round = max(kernels for _, _, kernels in while_loops(tree))
    # (+9 on the CPU with the 32-token chain; compiled for the H200, auto's tree loop holds 478
    # kernels an iteration against the fixed tree's 470.)
    assert fixed_round <= tree_round <= fixed_round + 16, (tree_round, fixed_round)


def test_the_h200_description_names_a_hopper_chip():
    text = count_kernels.TARGET_DESCRIPTION.read_text()
    assert 'device_description_str: "NVIDIA H200"' in text
    assert "cuda_compute_capability { major: 9 minor: 0 }" in text and "core_count: 132" in text


def test_the_kernel_list_names_each_counted_kernel_once_with_its_op():
    target = random_target(SMALL_CONFIG, seed=0, dtype="float32")
    draft = init_draft(target, seed=1, config=DraftConfig(window=16)).cast(jnp.float32)
    text = count_kernels.loop_program(target, draft, "longspec", 40, 8, "xla", jax.devices("cpu")[0], widths=(2, 2))
    rows = loop_body_kernel_list(text)
    assert len(rows) == loop_body_kernels(text)
    assert len({name for name, _, _ in rows}) == len(rows)
    assert collections.Counter(op for _, _, op in rows) == loop_body_kernels_by_op(text)
    # Each shape is an HLO array shape (or a tuple's), e.g. f32[1,2,64]{2,1,0}.
    assert all(re.match(r"^(pred|[sfu]\d+|bf16)\[", shape) for _, shape, _ in rows), rows[:5]
    assert any(op.endswith("dot_general") for _, _, op in rows)


def test_a_shape_cut_to_fewer_layers_keeps_everything_else():
    whole = MODEL_SHAPES["vicuna7b"]
    cut = count_kernels.cut_shape("vicuna7b", 2)
    assert cut.num_layers == 2 and dataclasses.replace(cut, num_layers=whole.num_layers) == whole
    assert count_kernels.cut_shape("vicuna7b") == whole
    for wrong in (0, whole.num_layers + 1):
        with pytest.raises(SystemExit, match="--layers must be 1 to 32"):
            count_kernels.cut_shape("vicuna7b", wrong)
