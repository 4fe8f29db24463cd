"""Kernels per AR step and per LongSpec round as XLA compiles them for an H200, on any machine.

XLA can compile for a GPU it does not have: given a description of the chip (benchmarks/h200.txtpb:
compute capability, SM count, memory sizes), the CUDA plugin's compiler runs its whole pipeline
(fusion, Triton for the Pallas kernels, scheduling) and returns the optimised program, which is all a
kernel count needs. This script builds the decode loop exactly as `Generator` does (the packed
inference layout, the requested attention implementation), compiles each loop for that description
and counts the kernels one iteration of its while body launches (`decode_kernels.loop_body_kernels`).
Times still need the GPU: `benchmarks/decode_kernels.py` measures them there, with the same count.

Needs the CUDA plugin wheels of the installed jax (no GPU, no driver):

    pip install "jax-cuda13-plugin==$(python -c 'import jax; print(jax.__version__)')" \\
                "jax-cuda13-pjrt==$(python -c 'import jax; print(jax.__version__)')"
    JAX_PLATFORMS=cpu python -m benchmarks.count_kernels --hlo-out /tmp/hlo --by-op 20
    JAX_PLATFORMS=cpu python -m benchmarks.count_kernels --modes auto,longspec --tree-widths 4,4,4 \\
        --temperature 1 --loops
    JAX_PLATFORMS=cpu python -m benchmarks.count_kernels --shape vicuna7b --layers 2 --list

A 7B shape compiles on a CPU in well under a minute cut to a few layers (--layers): each layer adds
the same kernels, so two cuts give a layer's kernels and what the round launches outside the layers
(the draft's levels, the acceptance). --list prints the loop body's kernels in the order XLA
scheduled them, each with its output's shape and the JAX operation it comes from.

SmolLM2-135M's shape with random weights by default (a program's kernels do not depend on the
weights); a 4,500-token prompt and 256 new tokens size the cache as `Generator` would.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from pathlib import Path
from unittest import mock

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks.decode_kernels import loop_body_kernel_list, loop_body_kernels, loop_body_kernels_by_op, while_loops
from infer.generate import parse_tree_widths
from longspec_jax.adaptive import adaptive_proposer, candidate_plan
from longspec_jax.config import ModelConfig
from longspec_jax.decode_kit import StopRule, plan_lengths
from longspec_jax.decode_loop import LoopConfig, decode, start, started
from longspec_jax.draft_io import init_draft
from longspec_jax.model import SMALL_ROWS, init_cache, small_rows_for
from longspec_jax.model_shapes import MODEL_SHAPES
from longspec_jax.proposers import proposer_for
from longspec_jax.sampling import SamplingParams
from longspec_jax.target import random_target
from pallas_kernels import flash_block

TARGET_DESCRIPTION = Path(__file__).resolve().parent / "h200.txtpb"


def cut_shape(name: str, layers: int | None = None) -> ModelConfig:
    """MODEL_SHAPES[name], cut to its first `layers` layers where given."""
    config = MODEL_SHAPES[name]
    if layers is None:
        return config
    if not 1 <= layers <= config.num_layers:
        raise SystemExit(f"--layers must be 1 to {config.num_layers} for {name}, got {layers}")
    return dataclasses.replace(config, num_layers=layers)


def gpu_device(description: Path = TARGET_DESCRIPTION):
    """A compile-only CUDA device for the chip `description` describes."""
    from jax.experimental import topologies

    try:
        topology = topologies.get_topology_desc(
            "h200", platform="cuda", target_config=description.read_text(), topology="1x1x1"
        )
    except (RuntimeError, NotImplementedError, ValueError) as err:
        raise SystemExit(
            f"cannot compile for a GPU here ({err}); install the CUDA plugin wheels of jax "
            f"{jax.__version__}: pip install jax-cuda13-plugin=={jax.__version__} jax-cuda13-pjrt=={jax.__version__}"
        ) from err
    return topology.devices[0]


def _on(device, tree):
    """Every array leaf of `tree` as a ShapeDtypeStruct placed on `device`."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def loop_program(
    target,
    draft,
    mode: str,
    prompt_tokens: int,
    new_tokens: int,
    attn_impl: str,
    device,
    widths=None,
    batch: int = 1,
    small_rows=None,
    temperature: float = 0.0,
    lookup_tokens: int | None = None,
):
    """The optimised HLO text of the decode loop `Generator` would run for `batch` prompts at
    `temperature` (0: greedy), compiled for `device` (a compile-only GPU from `gpu_device`, or any
    attached device). Mode "auto": the adaptive loop of the candidate plan for that sampling and
    batch size, which picks a candidate each round (`widths` does not apply); the other modes
    compile one program for every temperature. small_rows: the inference layout's small-row
    products, the target's and the draft's (default: what that device decodes with). lookup_tokens:
    the prompt-lookup chain beside the tree (None: the mode's default, as `Generator`'s)."""
    rows = small_rows_for(device.platform) if small_rows is None else small_rows
    if mode == "auto":
        plan = candidate_plan(draft is not None, temperature == 0.0, batch, lookup_tokens)
        proposer, proposer_params = adaptive_proposer(target, draft, plan, small_rows=rows)
        slack = proposer.slack
    else:
        proposer, proposer_params = proposer_for(
            mode, target, draft, widths, small_rows=rows, lookup_tokens=lookup_tokens or 0
        )
        slack = sum(proposer.widths)
    model = target.model.inference_layout(rows)
    graphdef, params = nnx.split(model)
    prompt_bucket, new_bucket, cache_rows = plan_lengths(prompt_tokens, new_tokens, slack=slack)
    config = LoopConfig(graphdef, proposer, new_bucket, attn_impl)
    sampling = SamplingParams.create(temperature)
    stop = StopRule.create(target.config.eos_token_ids, new_tokens)
    cache = jax.eval_shape(lambda: init_cache(target.config, batch, cache_rows, model.dtype))
    start_args = (
        params,
        proposer_params,
        cache,
        jax.ShapeDtypeStruct((batch, prompt_bucket), jnp.int32),
        jax.ShapeDtypeStruct((batch,), jnp.int32),
        jax.ShapeDtypeStruct((batch, target.config.vocab_size), jnp.float32),
        sampling,
        jax.random.key(0),
        stop,
    )
    state = started(functools.partial(jax.eval_shape, functools.partial(start, config=config)), *start_args)
    args = (params, proposer_params, state, jnp.asarray(0, jnp.int32), sampling)
    # The Pallas kernels run in the interpreter off GPU; compiled for a GPU they must be Triton, and
    # Pallas reads the chip's kind from the default device.
    on_gpu = device.platform != "cpu"
    with mock.patch.object(flash_block, "default_interpret", lambda: not on_gpu), jax.default_device(device):
        lowered = decode.lower(*_on(device, args), config=config)
    return lowered.compile().as_text()


def main(argv=None) -> dict[str, int]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=4500)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--attn-impl", choices=("xla", "cudnn", "pallas"), default="pallas")
    parser.add_argument("--shape", default="smollm2_135m", choices=sorted(MODEL_SHAPES))
    parser.add_argument("--layers", type=int, help="the shape cut to this many layers (default: all of them)")
    parser.add_argument("--modes", default="ar,longspec", help="comma-separated: ar, pld, longspec, auto")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature (mode auto's candidates depend on it)"
    )
    parser.add_argument("--tree-widths", help="the mode's tree (pld: a chain of len(widths) tokens), e.g. 4,16,16")
    parser.add_argument(
        "--lookup-tokens",
        type=int,
        default=None,
        help="longspec's tree (auto: its greedy trees) with a prompt-lookup chain of this many tokens "
        "(default: none in longspec, auto's own default beside its greedy trees; 0: none)",
    )
    parser.add_argument(
        "--no-small-rows", action="store_true", help="products of 1-3 rows as dots (the layout before SMALL_ROWS)"
    )
    parser.add_argument("--list", action="store_true", help="also print every kernel of the loop body in order")
    parser.add_argument("--hlo-out", type=Path, help="write each loop's optimised HLO text here")
    parser.add_argument("--by-op", type=int, default=0, metavar="N", help="also print the N JAX ops with most kernels")
    parser.add_argument(
        "--loops", action="store_true", help="also print every while loop's kernels (mode auto: one per candidate)"
    )
    parser.add_argument(
        "--fused-projections", action="store_true", help="each layer's projections as fused Pallas kernels"
    )
    parser.add_argument(
        "--norms-in-xla",
        action="store_true",
        help="the one-token step's residual adds and norms as XLA's ops, not residual_norm kernels",
    )
    args = parser.parse_args(argv)

    device = gpu_device()
    target = random_target(cut_shape(args.shape, args.layers), seed=0, dtype="bfloat16")
    target.model.fused_projections = args.fused_projections
    target.model.norm_kernels = not args.norms_in_xla
    draft = init_draft(target, seed=1).cast(jnp.bfloat16)
    projections = "fused" if args.fused_projections else "XLA"
    print(
        f"compiled for: {device.device_kind}; jax {jax.__version__}; {args.shape}, "
        f"{target.config.num_layers} layers, batch {args.batch}, "
        f"T = {args.temperature:g}, "
        f"attention {args.attn_impl}, projections {projections}, small-row products "
        f"{'off' if args.no_small_rows else SMALL_ROWS}"
    )
    counts = {}
    for mode in args.modes.split(","):
        text = loop_program(
            target,
            draft,
            mode,
            args.prompt_tokens,
            args.new_tokens,
            args.attn_impl,
            device,
            widths=parse_tree_widths(args.tree_widths),
            batch=args.batch,
            small_rows=() if args.no_small_rows else SMALL_ROWS,
            temperature=args.temperature,
            lookup_tokens=args.lookup_tokens if mode in ("longspec", "auto") else 0,
        )
        counts[mode] = loop_body_kernels(text)
        print(f"{mode}: {counts[mode]} kernels per loop iteration")
        if args.loops:
            for body, condition_kernels, body_kernels in while_loops(text):
                print(f"  loop {body}: {condition_kernels} kernels a condition, {body_kernels} an iteration")
        for op, n in loop_body_kernels_by_op(text).most_common(args.by_op):
            print(f"  {n:4d}  {op}")
        if args.list:
            for i, (name, shape, op) in enumerate(loop_body_kernel_list(text)):
                print(f"  {i:4d}  {name[:36]:36s} {shape[:48]:48s} {op}")
        if args.hlo_out is not None:
            args.hlo_out.mkdir(parents=True, exist_ok=True)
            (args.hlo_out / f"{mode}.hlo.txt").write_text(text)
    return counts


if __name__ == "__main__":
    main()
