"""Generate text from a prompt file: `python -m infer.generate --prompt-file examples/doc.txt`.

Prints the text (streamed when stdout is a terminal) and then one stats line on stderr; `--json`
prints one JSON object {tokens, text, stats} instead. Without --target it runs the embedded
SmolLM2-135M-Instruct. Mistakes a user can fix print one line and exit with status 2. Ctrl-C exits
with status 130 and no traceback, after printing what was generated so far (in --json mode with
"interrupted": true in the stats).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

import jax

from longspec_jax.adaptive import DEFAULT_LOOKUP_TOKENS
from longspec_jax.attention import IMPLS
from longspec_jax.draft_head import HEAD_FORMATS
from longspec_jax.draft_io import inference_draft, sampling_draft_for
from longspec_jax.errors import UserError
from longspec_jax.generation import AUTO_MODE, DEFAULT_MODE, MODES, Generator
from longspec_jax.int8_rows import BLOCK_FORMATS
from longspec_jax.target import load_target
from longspec_jax.tokenizer import decode, encode_prompt
from longspec_jax.tree import MAX_TREE_NODES

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT: what a shell reports for a process that Ctrl-C stopped
INT32_MAX = 2**31 - 1
# JAX keys take 32-bit seeds unless x64 is on: larger seeds would silently repeat smaller ones.
SEED_MAX = 2**32 - 1


class OneLineErrorParser(argparse.ArgumentParser):
    """Bad arguments are a UserError like every other mistake: one `error:` line, exit status 2."""

    def error(self, message: str):
        raise UserError(f"{message} (see --help)")


def int_in_range(low: int, high: int, meaning: str = ""):
    """An argparse type: an integer from `low` to `high`, else one line naming the range."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be an integer from {low} to {high}{meaning}, got {text!r}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(prog="python -m infer.generate", description=__doc__.splitlines()[0])
    p.add_argument("--prompt-file", required=True, type=Path, help="UTF-8 text file with the prompt")
    p.add_argument("--target", help="HF checkpoint directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--draft", help="LongSpec draft checkpoint (default: the one shipped for the target, if any)")
    p.add_argument(
        "--sampling-draft",
        help="the draft when sampling (--temperature > 0; default: --draft where given, else the one shipped "
        "for the target to sample with, else the shipped draft)",
    )
    p.add_argument(
        "--mode",
        choices=(*MODES, AUTO_MODE),
        default=DEFAULT_MODE,
        help=f"decoding mode (default {DEFAULT_MODE}: each round AR, prompt lookup or, with a draft given or "
        "shipped for the target as for the embedded SmolLM2, the draft's tree, whichever is expected fastest)",
    )
    p.add_argument(
        "--tree-widths",
        help="tree widths per depth, e.g. 4,16,16,16,16 (longspec; 1,1,1 is a chain the draft draws at "
        "random, verified by speculative sampling; pld takes a chain such as 1,1,1,1)",
    )
    p.add_argument(
        "--lookup-tokens",
        type=int_in_range(0, MAX_TREE_NODES),
        default=None,
        help="a prompt-lookup chain of this many tokens beside the draft's tree, verified with it: a round keeps "
        f"the longer of the two (0 = none; default: {DEFAULT_LOOKUP_TOKENS} beside mode auto's greedy tree, "
        "none in mode longspec)",
    )
    p.add_argument(
        "--full-draft-vocabulary",
        action="store_true",
        help="let the draft propose from the whole vocabulary, not only the candidate tokens it was saved with",
    )
    p.add_argument(
        "--draft-head",
        choices=HEAD_FORMATS,
        default="auto",
        help="how the draft reads the LM head: int8 rows (half the bytes; the output stays the target's), "
        "the target's own, or auto (int8 for a head of 64 MiB or more)",
    )
    p.add_argument(
        "--draft-block",
        choices=BLOCK_FORMATS,
        default="auto",
        help="how the draft holds its block's matrices: int8 rows (half the bytes; the output stays the "
        "target's), full (the dtype it runs in), or auto (int8 for a block of 64 MiB or more)",
    )
    p.add_argument("--max-new-tokens", type=int_in_range(1, INT32_MAX), default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int_in_range(0, INT32_MAX, " (0 = off)"), default=0, help="0 = off")
    p.add_argument("--seed", type=int_in_range(0, SEED_MAX), default=0)
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn of the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object {tokens, text, stats}")
    p.add_argument("--profile", action="store_true", help="also print per-step timings")
    p.add_argument("--attn-impl", choices=IMPLS, help="attention implementation (default: the fastest for the backend)")
    p.add_argument(
        "--dtype",
        choices=("auto", "bfloat16", "float32"),
        default="auto",
        help="weights dtype (auto: bfloat16 on GPU, float32 on CPU)",
    )
    return p


def read_prompt(path: Path) -> str:
    if not path.is_file():
        raise UserError(
            f"prompt file {path} does not exist or is not a file: pass an existing text file to --prompt-file"
        )
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(
            f"prompt file {path} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}): "
            "convert it, e.g. `iconv -t UTF-8`"
        ) from None
    if not text.strip():
        raise UserError(f"prompt file {path} is empty: put the prompt text in it")
    return text


def parse_widths(text: str, sep: str = ",") -> tuple[int, ...] | None:
    """Tree widths written as positive integers joined by `sep`, or None when `text` is not that."""
    try:
        widths = tuple(int(w) for w in text.split(sep))
    except ValueError:
        return None
    return widths if widths and min(widths) >= 1 else None


def parse_tree_widths(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    widths = parse_widths(text)
    if widths is None:
        raise UserError(f"--tree-widths must be comma-separated positive integers such as 4,16,16,16,16, got {text!r}")
    return widths


class TerminalOutput:
    """Streams text to stdout, or shows a progress bar on stderr, as the generate loop reports tokens."""

    def __init__(self, tokenizer, max_new_tokens: int, *, stream_text: bool, show_progress: bool):
        self.tokenizer = tokenizer
        self.stream_text = stream_text
        self.printed = ""
        self.bar = None
        if show_progress:
            from tqdm import tqdm

            self.bar = tqdm(total=max_new_tokens, desc="generate", unit="tok", file=sys.stderr, leave=False)

    @property
    def active(self) -> bool:
        return self.stream_text or self.bar is not None

    def __call__(self, tokens_so_far: list[list[int]]) -> None:
        tokens = tokens_so_far[0]
        if self.bar is not None:
            self.bar.update(len(tokens) - self.bar.n)
        if self.stream_text:
            text = decode(self.tokenizer, tokens)
            # Detokenisation can revise the last characters; print only the stable extension.
            if text.startswith(self.printed):
                sys.stdout.write(text[len(self.printed) :])
                sys.stdout.flush()
                self.printed = text

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def finish(self, text: str) -> None:
        self.close()
        if self.stream_text:
            sys.stdout.write(text[len(self.printed) :] if text.startswith(self.printed) else "\n" + text)
            sys.stdout.write("\n")
        else:
            print(text)


def _as_asked(draft, args: argparse.Namespace):
    """The draft with the vocabulary (--full-draft-vocabulary), head format (--draft-head) and block
    format (--draft-block) asked for."""
    if args.full_draft_vocabulary:
        draft = draft.with_candidate_tokens(None)
    return draft.with_head_format(args.draft_head).with_block_format(args.draft_block)


def run(args: argparse.Namespace) -> int:
    text = read_prompt(args.prompt_file)
    tree_widths = parse_tree_widths(args.tree_widths)
    if args.draft and args.mode not in ("longspec", AUTO_MODE):
        raise UserError("--draft applies to --mode longspec only: drop it or pass --mode longspec")
    if args.sampling_draft and args.mode not in ("longspec", AUTO_MODE):
        raise UserError("--sampling-draft applies to --mode longspec only: drop it or pass --mode longspec")
    if args.full_draft_vocabulary and args.mode not in ("longspec", AUTO_MODE):
        raise UserError("--full-draft-vocabulary applies to a draft's modes: drop it or pass --mode longspec")
    for flag, value in (("--draft-head", args.draft_head), ("--draft-block", args.draft_block)):
        if value != "auto" and args.mode not in ("longspec", AUTO_MODE):
            raise UserError(f"{flag} applies to a draft's modes: drop it or pass --mode longspec")
    if args.lookup_tokens and args.mode not in ("longspec", AUTO_MODE):
        raise UserError("--lookup-tokens goes beside a draft's tree: drop it or pass --mode longspec")
    if tree_widths and args.mode == "ar":
        raise UserError("--tree-widths applies to --mode longspec or pld only: drop it or pick one of those modes")

    tty_err = sys.stderr.isatty()
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if jax.default_backend() == "gpu" else "float32")
    if tty_err:
        print(f"loading target {args.target or '(embedded SmolLM2-135M-Instruct)'} ...", file=sys.stderr)
    target = load_target(args.target, dtype=dtype)
    if target.tokenizer is None:
        raise UserError("the target has no tokenizer: use a checkpoint directory with tokenizer files (or a .gguf)")
    draft = inference_draft(target, args.draft) if args.draft else None
    sampling_draft = inference_draft(target, args.sampling_draft) if args.sampling_draft else None
    if args.full_draft_vocabulary or args.draft_head != "auto" or args.draft_block != "auto":  # changed as asked
        sampling_draft = sampling_draft_for(target, draft, sampling_draft)
        draft = draft or inference_draft(target)
        # Once per draft: where one draft serves both, one copy does (a 7B draft's block is ~0.4 GB).
        changed = {id(d): _as_asked(d, args) for d in (draft, sampling_draft) if d is not None}
        draft, sampling_draft = (d and changed[id(d)] for d in (draft, sampling_draft))
    prompt_ids = encode_prompt(target.tokenizer, text, chat=args.chat)
    generator = Generator(
        target,
        draft,
        sampling_draft=sampling_draft,
        mode=args.mode,
        attn_impl=args.attn_impl,
        tree_widths=tree_widths,
        lookup_tokens=args.lookup_tokens,
    )
    if tree_widths and generator.mode == "ar":
        raise UserError("--tree-widths needs a draft (or --mode pld): this target has no shipped draft, pass --draft")
    if tty_err:
        print(
            f"mode {generator.mode}"
            + (" with the shipped draft" if generator.mode == "longspec" and draft is None else ""),
            file=sys.stderr,
        )

    stream_text = not args.json and sys.stdout.isatty()
    # Streamed text already shows progress; a bar on the same terminal would garble it.
    out = TerminalOutput(
        target.tokenizer, args.max_new_tokens, stream_text=stream_text, show_progress=tty_err and not stream_text
    )
    if tty_err:
        print(f"prefill {len(prompt_ids)} tokens (the first run of a length bucket also compiles) ...", file=sys.stderr)
    interrupted = False
    try:
        result = generator.generate(
            prompt_ids,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stream=out if out.active else None,
            profile=args.profile,
        )
    except KeyboardInterrupt as interrupt:
        leave_on_next_ctrl_c()
        out.close()
        # The generate loop hands over what it made before the interrupt, when it made anything.
        result = getattr(interrupt, "result", None)
        if result is None:
            raise
        interrupted = True
    new_text = result.text[0] if result.text is not None else decode(target.tokenizer, result.tokens[0])
    if args.json:
        stats = {**result.stats.to_dict(), "interrupted": interrupted}
        print(json.dumps({"tokens": result.tokens[0], "text": new_text, "stats": stats}))
    else:
        out.finish(new_text)
        print(result.stats.line() + (" | interrupted" if interrupted else ""), file=sys.stderr)
        if args.profile:
            print("profile: " + ", ".join(f"{k} {v:.3f}" for k, v in result.stats.profile.items()), file=sys.stderr)
    if interrupted:
        settle_device_work()
        return EXIT_INTERRUPTED
    return 0


def leave_on_next_ctrl_c() -> None:
    """After the first Ctrl-C, a second one ends the process at once (by the signal, as a shell
    expects) instead of raising KeyboardInterrupt again inside the clean exit."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def settle_device_work() -> None:
    """Wait for the computations dispatched before an interrupt: the interpreter then shuts down
    (and JAX drops its backends) with no device work still running under it, which is what can
    otherwise end in a C++ "terminate called" abort. What is in flight is what the host loop had
    queued when the interrupt landed (a prefill or a few decode steps), so the wait is short."""
    for array in jax.live_arrays():
        if not array.is_deleted():
            array.block_until_ready()


def main(argv: list[str] | None = None) -> int:
    try:
        return run(build_parser().parse_args(argv))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        leave_on_next_ctrl_c()
        settle_device_work()
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
