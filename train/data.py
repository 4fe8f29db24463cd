"""The training data: local files -> `datasets` (tokenised, cached) -> a grain pipeline of batches.

Records are either plain text (`text_field`: every token is trained on) or SFT pairs
(`prompt_field` + `response_field`: only the response and its EOS are trained on). Each record
becomes [BOS] + tokens + [EOS] (BOS only where the target's tokenizer adds one); the records are
shuffled with a seed (reshuffled each epoch), concatenated and split into rows of seq_len (grain's
concat-then-split), and batched.

`loss_mask[b, t] = 1` when token t is a training label (the prediction of token t from the tokens
before it counts). The iterator's state (grain `get_state`/`set_state`) goes into every checkpoint,
so a resumed run continues with exactly the batches an uninterrupted run would have seen.

Only this module imports `grain` and `datasets` (the GPU machine has neither; the benchmark does
not need them).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from longspec_jax.config import ModelConfig
from longspec_jax.errors import UserError
from train.data_errors import check_text_fields, unreadable

FORMATS = {
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
    ".txt": "text",
    ".md": "text",
    ".rst": "text",
    ".py": "text",
}


def data_format(path: Path) -> str | None:
    """The `datasets` loader for a file, looking through a .gz suffix (datasets reads gzip itself)."""
    suffixes = [x.lower() for x in path.suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes = suffixes[:-1]
    return FORMATS.get(suffixes[-1]) if suffixes else None


class TextEncoder(Protocol):
    bos: list[int]  # what starts every document (the BOS the target's tokenizer adds, if any)

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...


class ByteEncoder:
    """UTF-8 bytes as token ids 0..255: the tokenizer of a target that has none (random targets)."""

    def __init__(self, bos: list[int] | None = None):
        self.bos = list(bos or [])

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]


class HFEncoder:
    """A transformers-style tokenizer. Documents start the way the tokenizer starts a text by
    itself (Llama: BOS; Qwen2, SmolLM2: nothing); special tokens are otherwise added here."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        start = list(tokenizer("", add_special_tokens=True)["input_ids"])
        bos_id = getattr(tokenizer, "bos_token_id", None)
        self.bos = start[:1] if start and bos_id is not None and start[0] == bos_id else []

    def encode(self, text: str) -> list[int]:
        try:
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        except TypeError:  # tokenizers without that keyword
            return list(self.tokenizer.encode(text))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """A fast (Rust) tokenizer encodes a batch on all cores; others go one text at a time."""
        if not getattr(self.tokenizer, "is_fast", False):
            return [self.encode(t) for t in texts]
        return [list(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]


def text_encoder(tokenizer, model: ModelConfig) -> TextEncoder:
    if tokenizer is not None:
        return HFEncoder(tokenizer)
    if model.vocab_size < 257:
        raise UserError(
            f"the target has no tokenizer and vocab_size={model.vocab_size} is too small for UTF-8 "
            "bytes (needs >= 257): load a target with a tokenizer"
        )
    return ByteEncoder([model.bos_token_id] if model.bos_token_id is not None else [])


@dataclasses.dataclass(frozen=True)
class Corpus:
    """A tokenised corpus: `records` is a `datasets.Dataset` with columns tokens, loss_mask."""

    records: Any
    num_tokens: int
    files: tuple[str, ...]

    def steps_per_epoch(self, seq_len: int, batch_size: int) -> int:
        return self.num_tokens // seq_len // batch_size


def find_files(paths: tuple[str, ...] | list[str]) -> list[Path]:
    """The data files under `paths` (files or directories, searched recursively), in a fixed order."""
    return [f for _, f in _files_by_entry(paths)]


def _files_by_entry(paths) -> list[tuple[int, Path]]:
    """`find_files` with the index of the `paths` entry each file was found under."""
    if not paths:
        raise UserError("no training data given: pass --data PATH (a file or directory of .jsonl/.json/.parquet/.txt)")
    files: list[tuple[int, Path]] = []
    for i, p in enumerate(map(Path, paths)):
        if not p.exists():
            raise UserError(
                f"data path {p} does not exist: pass --data PATH (a file or directory of .jsonl/.json/.parquet/.txt)"
            )
        if p.is_dir():
            files += [(i, f) for f in sorted(f for f in p.rglob("*") if f.is_file() and data_format(f))]
        elif data_format(p):
            files.append((i, p))
        else:
            raise UserError(f"data file {p}: unknown format {p.suffix!r}; use one of {', '.join(sorted(FORMATS))}")
    if not files:
        raise UserError(f"no data files (.jsonl/.json/.parquet/.txt) under {', '.join(map(str, paths))}")
    return files


def load_corpus(
    paths,
    encoder: TextEncoder,
    model: ModelConfig,
    *,
    text_field="text",
    prompt_field="prompt",
    response_field="response",
    cache_dir: str | None = None,
    repeats=(),
) -> Corpus:
    """Load local files with `datasets` (never a hub) and tokenise them (cached by `datasets`).
    repeats: how many times each entry of `paths` has its records in the corpus (default once)."""
    import datasets
    from datasets.exceptions import DatasetGenerationError

    found = _files_by_entry(paths)
    files = [f for _, f in found]
    times = _repeats_by_file(found, len(paths), repeats)
    eos = list(model.eos_token_ids[:1])
    if not eos:
        raise UserError("the target config names no eos_token_id: documents could not be separated")
    parts = []
    # Each file is loaded by itself: loaded together, `datasets` casts a file's column to the first
    # file's type, turning a list (or a JSON-typed column) into its JSON text instead of failing.
    for path in sorted(files, key=data_format):  # grouped by format, in order within a format
        fmt, name = data_format(path), str(path)
        kwargs = {"sample_by": "document"} if fmt == "text" else {}
        try:
            raw = datasets.load_dataset(fmt, data_files=[name], split="train", cache_dir=cache_dir, **kwargs)
        except DatasetGenerationError as e:
            raise unreadable(fmt, name, e) from None
        columns = set(raw.column_names)
        if fmt == "text":
            fields = ("text", None)
        elif {prompt_field, response_field} <= columns:
            fields = (prompt_field, response_field)
        elif text_field in columns:
            fields = (text_field, None)
        else:
            raise UserError(
                f"{name}: records need a {text_field!r} field or {prompt_field!r} + {response_field!r} "
                f"fields (found {sorted(columns)}); set text_field/prompt_field/response_field with --set"
            )
        settings = {"text_field": text_field, "prompt_field": prompt_field, "response_field": response_field}
        check_text_fields(raw, fmt, name, {f: key for key, f in settings.items() if f in fields})
        tokenised = raw.map(
            _Tokenise(encoder, eos, *fields),
            batched=True,
            remove_columns=raw.column_names,
            desc=f"tokenising {path.name}",
        )
        parts += [tokenised] * times[path]
    records = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    records = records.filter(lambda n: n > 0, input_columns="length")
    num_tokens = int(np.sum(records["length"])) if len(records) else 0
    return Corpus(records=records.remove_columns("length"), num_tokens=num_tokens, files=tuple(map(str, files)))


def _repeats_by_file(found: list[tuple[int, Path]], entries: int, repeats) -> dict[Path, int]:
    """Each data file's repeat count: its `paths` entry's (a file under two entries takes the larger).
    found: `_files_by_entry`'s (entry index, file) pairs."""
    if repeats and len(repeats) != entries:
        raise UserError(f"{len(repeats)} data repeat counts for {entries} data paths: give one per path")
    times: dict[Path, int] = {}
    for i, f in found:
        times[f] = max(times.get(f, 1), int(repeats[i]) if repeats else 1)
    return times


class _Tokenise:
    """datasets.map function: a batch of records -> tokens, loss_mask, length (a class so it pickles)."""

    def __init__(self, encoder, eos, first_field, response_field):
        self.encoder, self.bos, self.eos = encoder, encoder.bos, eos
        self.first_field, self.response_field = first_field, response_field

    def __call__(self, batch):
        out = {"tokens": [], "loss_mask": [], "length": []}
        firsts = batch[self.first_field]
        responses = batch[self.response_field] if self.response_field else [None] * len(firsts)
        heads = self.encoder.encode_batch([first or "" for first in firsts])
        tails = self.encoder.encode_batch([r or "" for r in responses]) if self.response_field else responses
        for first_ids, tail_ids, response in zip(heads, tails, responses):
            head = self.bos + first_ids
            if response is None:  # plain text: every token after BOS is a label
                tokens = head + self.eos
                mask = [0] * len(self.bos) + [1] * (len(tokens) - len(self.bos))
            else:  # SFT: labels are the response and its EOS only
                tail = tail_ids + self.eos
                tokens, mask = head + tail, [0] * len(head) + [1] * len(tail)
            empty = len(tokens) == len(self.bos) + len(self.eos)
            out["tokens"].append(tokens)
            out["loss_mask"].append(mask)
            out["length"].append(0 if empty else len(tokens))
        return out


def batch_iterator(
    corpus: Corpus, *, seq_len: int, batch_size: int, seed: int, process_index: int = 0, process_count: int = 1
):
    """An endless grain iterator of {"tokens": int32[batch_size, seq_len], "loss_mask": int32[...]}
    for this process (its share of the records). Has get_state() / set_state()."""
    import grain
    from grain.experimental import ConcatThenSplitIterDataset, ThreadPrefetchIterDataset

    if len(corpus.records) < process_count:
        raise UserError(f"only {len(corpus.records)} records for {process_count} processes: add data")
    # Rows read as numpy arrays straight from Arrow: read as Python lists (the default format) the
    # pipeline made ~0.45 M tokens/s, less than one H200 trains on (benchmarks/bench_data_pipeline.py).
    ds = grain.MapDataset.source(corpus.records.with_format("numpy"))[process_index::process_count]
    ds = ds.shuffle(seed=seed).repeat().map(_as_arrays)
    # Records are already in memory-mapped Arrow: reading in the main thread keeps order trivially
    # deterministic and costs little next to a training step.
    it = ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
    it = ConcatThenSplitIterDataset(it, length_struct={"tokens": seq_len, "loss_mask": seq_len})
    it = it.map(_drop_packing_features).batch(batch_size, drop_remainder=True)
    # Batches are made in a background thread while the device runs the step. Its get_state()
    # is the state after the last batch handed out, so checkpoints stay exact.
    return iter(ThreadPrefetchIterDataset(it, prefetch_buffer_size=2))


def _as_arrays(record):
    return {"tokens": np.asarray(record["tokens"], np.int32), "loss_mask": np.asarray(record["loss_mask"], np.int32)}


def _drop_packing_features(packed):
    # Documents are concatenated and attended across (as the paper's pre-training data is), so the
    # segment ids and in-document positions grain adds are not needed.
    return {"tokens": packed["tokens"], "loss_mask": packed["loss_mask"]}
