"""Kernels per decode step and step time of the target, before and after the decode-path changes.

On an H200 (the embedded SmolLM2-135M in bfloat16, its shipped draft, a ~4.5k-token prompt cut
from examples/doc.txt):

    python -m benchmarks.decode_kernels

On the CPU with a tiny random model (a smoke run: the table's rows, no meaningful timings):

    JAX_PLATFORMS=cpu python -m benchmarks.decode_kernels --small

Variants (the same weights):
- before: the loaded layout (separate q/k/v and gate/up matrices) and one-token steps through the
  general block path (`hybrid_tree_attention`: the cache plus the new key under a 1 x 1 mask);
- after: `Transformer.inference_layout()` (packed q/k/v and gate/up) and the one-token path (the
  new K/V row written, then one attention over the cache);
- fused_projections: as after, with each layer's projections (the AR step's and a verified
  block's) as fused Pallas kernels (`fused_linear`) instead of XLA's products and separate norm,
  SwiGLU and residual kernels; the same program as after unless the attention impl is "pallas";
- norms_in_xla: as after, with the one-token step's residual adds and norms as XLA's add, sum of
  squares and scaling instead of one `residual_norm` kernel each (the same program as after unless
  the attention impl is "pallas").

For each variant and mode (AR; LongSpec when a draft is at hand) it prints the kernels in one
iteration of the compiled decode loop (its while body), the step (AR) or round (LongSpec) time
inside the device loop (the median over repeats of decode seconds / loop iterations, after a
warm-up run), tokens/s, and for AR the step's floor (`benchmarks.floors`: the weights and the KV
rows a step reads at the memory rate measured in the same run, or its matrix work at the matmul rate,
whichever is longer).
A short table closes the output.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import statistics
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import floors
from infer.generate import parse_tree_widths
from longspec_jax import decode_kit, generation
from longspec_jax.config import ModelConfig
from longspec_jax.draft import DraftConfig
from longspec_jax.draft_io import inference_draft, init_draft
from longspec_jax.model_shapes import MODEL_SHAPES
from longspec_jax.target import Target, load_target, random_target

DOC = Path(__file__).resolve().parent.parent / "examples" / "doc.txt"
# Instructions that launch nothing: they name, regroup or reinterpret buffers. Control flow is
# followed into the computations it calls.
FREE_OPS = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "opt-barrier", "after-all"}
CONTROL_OPS = {"while", "call", "conditional"}
INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = .*? ([a-z][a-z\-]*)\((.*)$")
# A launching instruction's name and output shape (a tuple's shapes without their parentheses).
LAUNCH_HEAD = re.compile(r"^\s*(?:ROOT )?%?(?P<name>[\w.\-]+) = (?:\((?P<tuple>[^)]*)\)|(?P<shape>\S+))")
SMALL_CONFIG = ModelConfig(
    model_type="llama",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    max_position_embeddings=1024,
    tie_word_embeddings=True,
)


# ----------------------------------------------------------------------------- kernel counts


def hlo_computations(text: str) -> dict[str, list[str]]:
    """Computation name -> its instruction lines, from an optimised HLO module's text."""
    computations, current = {}, None
    for line in text.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if header:
            current = computations.setdefault(header.group(1), [])
        elif line.strip() == "}":
            current = None
        elif current is not None:
            current.append(line)
    return computations


def _launches_in(name: str, computations: dict[str, list[str]]) -> list[str]:
    """The launching instruction lines of computation `name`, nested loops and calls walked into.
    A conditional counts as its largest branch (an iteration runs one) plus the kernel that sets
    its case."""
    lines = []
    for line in computations[name]:
        match = INSTRUCTION.match(line)
        if match is None or match.group(1) in FREE_OPS:
            continue
        if match.group(1) in CONTROL_OPS:
            rest = match.group(2)
            called = re.findall(r"(?:condition|body|to_apply)=%?([\w.\-]+)", rest)
            branches = re.findall(r"(?:true_computation|false_computation)=%?([\w.\-]+)", rest)
            for listed in re.findall(r"branch_computations=\{([^}]*)\}", rest):
                branches += [b.strip().lstrip("%") for b in listed.split(",")]
            for c in called:
                if c in computations:
                    lines += _launches_in(c, computations)
            taken = [_launches_in(b, computations) for b in branches if b in computations]
            if taken:
                lines += [line] + max(taken, key=len)
        else:
            lines.append(line)
    return lines


def _while_ops(computations: dict[str, list[str]]) -> list[tuple[str, str]]:
    """(condition, body) computation names of every while op, in the module's order."""
    found = (re.search(r"condition=%?([\w.\-]+), body=%?([\w.\-]+)", line) for c in computations.values() for line in c)
    return [m.groups() for m in found if m]


def _loop_body_launches(text: str) -> list[str]:
    computations = hlo_computations(text)
    loops = _while_ops(computations)
    if not loops:
        raise ValueError("no while loop in this program")
    return max((_launches_in(body, computations) for _, body in loops), key=len)


def loop_body_kernels(text: str) -> int:
    """Kernels launched by one iteration of the largest while loop of an optimised HLO module:
    every fusion, custom call and unfused op in its body (and in loops or calls nested there)."""
    return len(_loop_body_launches(text))


def while_loops(text: str) -> list[tuple[str, int, int]]:
    """Every while loop of an optimised HLO module, nested ones included: (body computation name,
    kernels its condition launches, kernels one iteration of its body launches), in the module's
    order. Mode auto's loop holds one inner loop per candidate; each runs that candidate's rounds."""
    computations = hlo_computations(text)
    return [
        (body, len(_launches_in(condition, computations)), len(_launches_in(body, computations)))
        for condition, body in _while_ops(computations)
    ]


def _jax_op(line: str) -> str:
    """The JAX operation a launching instruction comes from: the op_name of its metadata without the
    jit / while nesting (e.g. "dot_general", "jit(log_softmax)/reduce_max"), "?" where XLA kept none."""
    name = re.search(r'op_name="([^"]*)"', line)
    parts = (
        []
        if name is None
        else [p for p in name.group(1).split("/") if not re.fullmatch(r"jit\(decode\)|while|body|cond", p)]
    )
    return "/".join(parts) or "?"


def loop_body_kernels_by_op(text: str) -> collections.Counter:
    """`loop_body_kernels` split by the JAX operation each kernel comes from (`_jax_op`): where a
    loop's kernels come from."""
    return collections.Counter(_jax_op(line) for line in _loop_body_launches(text))


def loop_body_kernel_list(text: str) -> list[tuple[str, str, str]]:
    """`loop_body_kernels`' kernels one by one, in the order the compiled loop body holds them (XLA's
    schedule): (instruction name, its output's shape, the JAX operation it comes from)."""
    heads = (LAUNCH_HEAD.match(line) for line in _loop_body_launches(text))
    return [(head["name"], head["tuple"] or head["shape"], _jax_op(head.string)) for head in heads]


def new_loop_programs(before: set, hlo_out: Path | None = None, label: str = "") -> dict[str, int]:
    """Kernels per loop iteration of each program `generation.compiled` compiled since `before`
    (a set of its cache keys), by jitted function name. hlo_out: also write each program's
    optimised HLO there, as `<label>_<name>.hlo.txt`."""
    counts = {}
    for key, executable in decode_kit._COMPILED.items():
        if key not in before:
            text = executable.as_text()
            if " while(" in text:
                name = getattr(key[0], "__name__", str(key[0]))
                counts[name] = loop_body_kernels(text)
                if hlo_out is not None:
                    hlo_out.mkdir(parents=True, exist_ok=True)
                    (hlo_out / f"{label}_{name}.hlo.txt").write_text(text)
    return counts


# ----------------------------------------------------------------------------- timing


def measure(
    target, draft, mode, prompt, new_tokens, repeats, attn_impl=None, hlo_out=None, label="", tree_widths=None
) -> dict:
    """Compile (counting the loop's kernels), warm up, then the median ms per loop iteration."""
    kwargs = dict(mode=mode, max_new_tokens=new_tokens, eos_token_ids=(), draft=draft, attn_impl=attn_impl)
    kwargs["tree_widths"] = tree_widths
    known = set(decode_kit._COMPILED)
    generation.generate(target, prompt, **kwargs)  # compiles and warms up
    programs = new_loop_programs(known, hlo_out, label)
    ms, tokens_per_s, tau = [], [], []
    for _ in range(repeats):
        stats = generation.generate(target, prompt, **kwargs).stats
        ms.append(1e3 * stats.decode_s / max(stats.rounds, 1))
        tokens_per_s.append(stats.tokens_per_s)
        tau.append(stats.tau)
    return {
        "kernels": programs.get("decode", max(programs.values(), default=-1)),
        "ms": statistics.median(ms),
        "tokens_per_s": statistics.median(tokens_per_s),
        "tau": statistics.median(tau),
    }


# ----------------------------------------------------------------------------- setup


class _AsLoaded(Target):
    """A target whose Generators decode with the loaded layout, not the packed inference layout."""

    def decode_model(self):
        return self.model


VARIANTS = ("before", "after", "fused_projections", "norms_in_xla")


def variants(target) -> dict[str, Target]:
    before = nnx.clone(target.model)
    before.one_token_attention = False
    fused_projections = nnx.clone(target.model)
    fused_projections.fused_projections = True
    norms_in_xla = nnx.clone(target.model)
    norms_in_xla.norm_kernels = False
    return {
        "before": _AsLoaded(target.config, before, target.tokenizer, target.shipped_draft),
        "after": Target(target.config, target.model, target.tokenizer, target.shipped_draft),
        "fused_projections": Target(target.config, fused_projections, target.tokenizer, target.shipped_draft),
        "norms_in_xla": Target(target.config, norms_in_xla, target.tokenizer, target.shipped_draft),
    }


def setup(small: bool, prompt_tokens: int, target_path: str | None = None, random_weights: str | None = None):
    """(target, draft or None, prompt token ids). random_weights: a `MODEL_SHAPES` name."""
    if random_weights:  # a step's kernels and time do not depend on the weights; tau does
        target = random_target(MODEL_SHAPES[random_weights], seed=0, dtype="bfloat16")
        draft = init_draft(target, seed=1).cast(jnp.bfloat16)
        prompt = np.random.default_rng(0).integers(0, target.config.vocab_size, prompt_tokens).tolist()
        return target, draft, prompt
    if small:
        target = random_target(SMALL_CONFIG, seed=0, dtype="float32")
        draft = init_draft(target, seed=1, config=DraftConfig(window=16))
        prompt = np.random.default_rng(0).integers(0, SMALL_CONFIG.vocab_size, prompt_tokens).tolist()
        return target, draft, prompt
    target = load_target(target_path, dtype="bfloat16")
    ids = list(target.tokenizer.encode(DOC.read_text()))
    prompt = (ids * (prompt_tokens // len(ids) + 1))[:prompt_tokens]
    return target, inference_draft(target), prompt


def eval_prompt(path: Path, index: int) -> list[int]:
    """The token ids of prompt number `index` of an eval set's .jsonl (infer.build_eval_sets)."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return rows[index]["prompt_ids"]


def with_vocabulary(draft, vocabulary: str):
    """The draft proposing from `vocabulary` (--candidate-tokens: "saved", "all" or a count N, the
    first N token ids)."""
    if vocabulary == "saved":
        return draft
    if vocabulary == "all":
        return draft.with_candidate_tokens(None)
    if not vocabulary.isdigit() or int(vocabulary) < 1:
        raise SystemExit(f"--candidate-tokens: {vocabulary!r} is neither saved, all nor a positive count")
    return draft.with_candidate_tokens(np.arange(min(int(vocabulary), draft.target_config.vocab_size)))


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a tiny random model (CPU smoke run)")
    parser.add_argument("--prompt-tokens", type=int, default=None, help="prompt length (4500; 100 with --small)")
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens per run (256; 16 with --small)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs after the warm-up (5; 1 with --small)")
    parser.add_argument("--no-longspec", action="store_true", help="AR only")
    parser.add_argument("--target", help="a .gguf or HF directory (default: the embedded SmolLM2)")
    parser.add_argument(
        "--random",
        nargs="?",
        const="smollm2_135m",
        choices=sorted(MODEL_SHAPES),
        metavar="SHAPE",
        help="random weights and draft of a model shape (SmolLM2's without SHAPE; e.g. llama31_8b)",
    )
    parser.add_argument("--hlo-out", type=Path, help="write each decode loop's optimised HLO text here")
    parser.add_argument("--attn-impl", choices=("xla", "cudnn", "pallas"), help="default: fastest for the backend")
    parser.add_argument("--variants", help=f"comma-separated, of: {', '.join(VARIANTS)} (default: all)")
    parser.add_argument("--tree-widths", help="LongSpec's tree, e.g. 4,4,4 (default: the default tree)")
    parser.add_argument("--json", type=Path, help="also write the table's rows here, as a JSON list")
    parser.add_argument(
        "--candidate-tokens",
        default="saved",
        help="comma-separated draft vocabularies, LongSpec timed with each: saved (the draft's own), all (the "
        "whole vocabulary), or N (the first N token ids: a cut's cost, whatever its tokens; e.g. all,16384)",
    )
    args = parser.parse_args(argv)
    chosen = VARIANTS if not args.variants else tuple(args.variants.split(","))
    if set(chosen) - set(VARIANTS):
        parser.error(f"unknown variants {sorted(set(chosen) - set(VARIANTS))}; choose from {', '.join(VARIANTS)}")
    prompt_tokens = args.prompt_tokens or (100 if args.small else 4500)
    new_tokens = args.new_tokens or (16 if args.small else 256)
    repeats = args.repeats or (1 if args.small else 5)

    target, draft, prompt = setup(args.small, prompt_tokens, args.target, args.random)
    rates = floors.measure_rates(small=args.small)
    impl = args.attn_impl or "default"
    print(
        f"{jax.devices()[0].device_kind}, jax {jax.__version__}; prompt {len(prompt)} tokens, {new_tokens} new; {impl}"
    )
    print(f"floors at {rates.bandwidth / 1e9:.0f} GB/s and {rates.matmul / 1e12:.0f} TFLOP/s (bf16 matmul)")
    rows = []
    widths = parse_tree_widths(args.tree_widths)
    for name, variant in variants(target).items():
        if name not in chosen:
            continue
        ar = measure(variant, None, "ar", prompt, new_tokens, repeats, args.attn_impl, args.hlo_out, name)
        # the K/V rows at the generation's midpoint
        floor_ms = 1e3 * floors.step_seconds(variant.model, 1, len(prompt) + new_tokens // 2, 1, rates)
        row = {
            "variant": name,
            "ar_kernels": ar["kernels"],
            "ar_step_ms": ar["ms"],
            "ar_tokens_per_s": ar["tokens_per_s"],
        }
        row |= {"floor_ms": floor_ms, "ar_vs_floor": ar["ms"] / floor_ms}
        print(
            f"{name}: AR {ar['kernels']} kernels/step, {ar['ms']:.3f} ms/step, {ar['tokens_per_s']:.0f} tokens/s, "
            f"floor {floor_ms:.3f} ms ({row['ar_vs_floor']:.1f}x)"
        )
        if draft is None or args.no_longspec:
            rows.append(row)
            continue
        vocabularies = args.candidate_tokens.split(",")
        for vocabulary in vocabularies:
            label = name if vocabularies == ["saved"] else f"{name}, {vocabulary} candidates"
            spec = measure(
                variant,
                with_vocabulary(draft, vocabulary),
                "longspec",
                prompt,
                new_tokens,
                repeats,
                args.attn_impl,
                args.hlo_out,
                name,
                widths,
            )
            spec_row = row | {"variant": label, "round_kernels": spec["kernels"], "round_ms": spec["ms"]}
            spec_row |= {"round_vs_ar_step": spec["ms"] / ar["ms"]}
            spec_row |= {"longspec_tokens_per_s": spec["tokens_per_s"], "tau": spec["tau"]}
            print(
                f"{label}: LongSpec {spec['kernels']} kernels/round, {spec['ms']:.3f} ms/round "
                f"({spec_row['round_vs_ar_step']:.2f} AR steps), tau {spec['tau']:.2f}, "
                f"{spec['tokens_per_s']:.0f} tokens/s"
            )
            rows.append(spec_row)
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return rows


def print_table(rows: list[dict]) -> None:
    columns = [
        ("variant", "variant", "{}"),
        ("ar_kernels", "AR kernels", "{}"),
        ("ar_step_ms", "AR ms", "{:.3f}"),
        ("ar_tokens_per_s", "AR tok/s", "{:.0f}"),
        ("floor_ms", "floor ms", "{:.3f}"),
        ("ar_vs_floor", "x floor", "{:.1f}"),
        ("round_kernels", "round kernels", "{}"),
        ("round_ms", "round ms", "{:.3f}"),
        ("round_vs_ar_step", "round/AR", "{:.2f}"),
        ("longspec_tokens_per_s", "LongSpec tok/s", "{:.0f}"),
    ]
    cells = [[title for _, title, _ in columns]]
    cells += [[fmt.format(row[key]) if key in row else "-" for key, _, fmt in columns] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    print()
    for r in cells:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))


if __name__ == "__main__":
    main()
