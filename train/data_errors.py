"""One-line errors for data files that `datasets` cannot read, or whose text fields hold no text.

`datasets` reports a malformed file as a DatasetGenerationError, and a number or list where text
belongs would surface later, inside tokenisation. These helpers run only once
something is wrong: they reread the files to name the file, the line (JSON) and the fix.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path

from longspec_jax.errors import UserError

TEXT_TYPES = ("string", "large_string", "null")  # null: every value missing (such records are dropped)


class _BadJson(Exception):
    """A place in a JSON file and what is wrong there."""


def unreadable(fmt: str, file: str, error: Exception) -> UserError:
    """The UserError for `datasets.load_dataset(fmt, [file])` failing with `error`."""
    if fmt == "json":
        try:
            for _ in _json_records(Path(file)):
                pass
        except _BadJson as bad:
            return UserError(f"{bad}: fix or remove that record")
    cause = error.__cause__ or error
    detail = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
    return UserError(f"cannot read {file} as {fmt} data ({detail}): fix or remove the file")


def check_text_fields(raw, fmt: str, file: str, settings: dict[str, str]) -> None:
    """Raise a UserError when a column in `settings` (field -> the --set key choosing it) is not text."""
    for field, setting in settings.items():
        dtype = getattr(raw.features[field], "dtype", None)
        if dtype in TEXT_TYPES:
            continue
        where, found = _first_non_text(fmt, file, field) or (file, f"of type {raw.features[field]}")
        raise UserError(
            f"{where}: field {field!r} is {found}, not a string: make it text, or train on another "
            f"field (--set {setting}=...)"
        )


def _first_non_text(fmt: str, file: str, field: str) -> tuple[str, str] | None:
    if fmt != "json":
        return None
    for where, record in _json_records(Path(file)):
        value = record.get(field) if isinstance(record, dict) else None
        if value is not None and not isinstance(value, str):
            return where, json.dumps(value)[:40]
    return None


def _json_records(path: Path) -> Iterator[tuple[str, object]]:
    """(place, record) for a JSON-lines file, or for the records of a one-document JSON file (a list)."""
    try:
        with _open_text(path) as f:
            lines = enumerate(f, 1)
            first = next(((n, line) for n, line in lines if line.strip()), None)
            if first is None:
                return
            if _parses(first[1]):
                for n, line in [first, *lines]:
                    if line.strip():
                        yield f"{path}:{n}", _loads(line, f"{path}:{n}")
                return
        with _open_text(path) as f:
            try:
                doc = json.load(f)
            except json.JSONDecodeError as e:
                raise _BadJson(f"{path}:{e.lineno}: not valid JSON ({e.msg}, column {e.colno})") from None
    except UnicodeDecodeError as e:
        raise _BadJson(f"{path}: not UTF-8 text ({e.reason} at byte {e.start} of a block)") from None
    for i, record in enumerate(doc if isinstance(doc, list) else [doc], 1):
        yield f"{path} record {i}", record


def _loads(line: str, where: str):
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise _BadJson(f"{where}: not valid JSON ({e.msg}, column {e.colno})") from None


def _parses(line: str) -> bool:
    try:
        json.loads(line)
    except json.JSONDecodeError:
        return False
    return True


def _open_text(path: Path):
    if path.suffix.lower() == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")
