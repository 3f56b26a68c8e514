"""JSONL records: reading a dataset file line by line and checking every record's shape.

Three formats, one per file: `{"text": ...}`, `{"prompt": ..., "completion": ...}` and
`{"messages": [{"role": ..., "content": ...}, ...]}`. With `format: auto` the first record decides, and
every later record must be of that format too: a file that mixes them is almost always a mistake (two
sets concatenated), and silently training on both would hide it. Fields other than the format's are
ignored, so records may carry ids or metadata.

Everything streams: `read_records` yields one record at a time and `scan` (the pass that validates a whole
file before training) keeps only counts, so a file is never held in memory. A bad record fails with
`file:line: problem`.

A file is read again for every epoch, so it must stay what the validating pass saw: `scan` records its
`Stamp` (device, inode, size, modification time) and every later read checks it when it opens the file and
when it reaches the end, so a file emptied or edited under a run fails naming it instead of training on
something unvalidated (or, emptied, spinning through empty epochs).
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Union

__all__ = ["DatasetError", "RecordError", "Format", "TextRecord", "PromptCompletion", "Messages", "Record", "ROLES",
           "read_records", "scan", "Scan", "Stamp"]

Format = Literal["text", "prompt_completion", "messages"]
ROLES = ("system", "user", "assistant")


class DatasetError(ValueError):
    """A dataset cannot be used; the message names the file (and line) and what is wrong."""


class RecordError(ValueError):
    """One record is bad; the reader adds the file and line."""


@dataclass(frozen=True)
class TextRecord:
    text: str


@dataclass(frozen=True)
class PromptCompletion:
    prompt: str
    completion: str


@dataclass(frozen=True)
class Messages:
    messages: tuple[tuple[str, str], ...]  # (role, content), in order

    def as_dicts(self) -> list[dict[str, str]]:
        """The shape `apply_chat_template` takes."""
        return [{"role": role, "content": content} for role, content in self.messages]


Record = Union[TextRecord, PromptCompletion, Messages]


def record_format(obj: dict[str, object], text_field: str) -> Format | None:
    """The format a record's fields say it is (None: no known field)."""
    if "messages" in obj:
        return "messages"
    if "prompt" in obj or "completion" in obj:
        return "prompt_completion"
    if text_field in obj:
        return "text"
    return None


def _string(obj: dict[str, object], key: str, where: str = "") -> str:
    if key not in obj:
        raise RecordError(f"no {key!r} field{where}")
    value = obj[key]
    if not isinstance(value, str):
        raise RecordError(f"field {key!r}{where} must be a string, got {type(value).__name__}")
    return value


def _messages(value: object) -> Messages:
    if not isinstance(value, list):
        raise RecordError(f"field 'messages' must be a list, got {type(value).__name__}")
    if not value:
        raise RecordError("field 'messages' is empty")
    turns = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise RecordError(f"messages[{i}] must be an object, got {type(item).__name__}")
        role = _string(item, "role", f" in messages[{i}]")
        if role not in ROLES:
            raise RecordError(f"messages[{i}]: unknown role {role!r} (expected one of {', '.join(ROLES)})")
        turns.append((role, _string(item, "content", f" in messages[{i}]")))
    if turns[0][0] == "assistant":
        # The assistant tokens are told apart by rendering what precedes each turn, and a chat template
        # cannot render an empty conversation.
        raise RecordError("messages[0] is an assistant turn: a conversation starts with a system or user turn")
    if not any(role == "assistant" for role, _ in turns):
        raise RecordError("no assistant turn: a messages record trains only on assistant turns, so it needs one")
    return Messages(tuple(turns))


def parse_record(obj: object, fmt: Format, text_field: str, why: str) -> Record:
    """One JSON value as a record of format `fmt`; `why` says where that format came from, for the error."""
    if not isinstance(obj, dict):
        raise RecordError(f"expected a JSON object, got {type(obj).__name__}")
    own = record_format(obj, text_field)
    if own is not None and own != fmt:
        raise RecordError(f"a {own} record, but the dataset's format is {fmt} ({why})")
    if fmt == "text":
        return TextRecord(_string(obj, text_field))
    if fmt == "prompt_completion":
        return PromptCompletion(_string(obj, "prompt"), _string(obj, "completion"))
    if "messages" not in obj:
        raise RecordError("no 'messages' field")
    return _messages(obj["messages"])


@dataclass(frozen=True)
class Stamp:
    """Which file a path is and what it holds, as far as the filesystem tells without reading it."""

    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: Path) -> Stamp:
        try:
            st = os.stat(path)
        except OSError as exc:
            raise DatasetError(f"{path}: cannot read: {exc.strerror or exc}") from None
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def check(self, path: Path) -> None:
        """Fail naming `path` when it is no longer the file this stamp was taken of."""
        now = Stamp.of(path)
        if now != self:
            what = "replaced by another file" if (now.device, now.inode) != (self.device, self.inode) else "modified"
            raise DatasetError(f"{path}: changed while the run was reading it ({what}: {self.size} bytes when the run "
                               f"started, now {now.size} bytes): a dataset must stay as it is until the run ends")


def _lines(path: Path, stamp: Stamp | None = None) -> Iterator[tuple[int, object]]:
    """(line number, JSON value) of every non-blank line; with a `stamp`, the file must still match it when it
    is opened and when its end is reached."""
    try:
        handle = path.open("rb")  # bytes, decoded per line, so a bad byte is reported with its line
    except OSError as exc:
        raise DatasetError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if stamp is not None:
        stamp.check(path)
    with handle:
        for number, raw in enumerate(handle, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DatasetError(f"{path}:{number}: not UTF-8 text: {exc.reason} at byte {exc.start}") from None
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path}:{number}: malformed JSON: {exc.msg} (column {exc.colno})") from None
    if stamp is not None:
        stamp.check(path)


def resolve_format(path: Path, fmt: Literal["auto"] | Format, text_field: str) -> tuple[Format, str]:
    """The file's format and why (for errors): as the spec sets it, or that of the first record."""
    if fmt != "auto":
        return fmt, "set by dataset.format"
    for number, obj in _lines(path):
        if not isinstance(obj, dict):
            raise DatasetError(f"{path}:{number}: expected a JSON object, got {type(obj).__name__}")
        own = record_format(obj, text_field)
        if own is None:
            raise DatasetError(f"{path}:{number}: no {text_field!r}, 'prompt'/'completion' or 'messages' field: "
                               "cannot tell the dataset's format (set dataset.format or dataset.textField)")
        return own, f"that of line {number}"
    raise DatasetError(f"{path}: holds no records")


def read_records(path: Path, fmt: Format, text_field: str, why: str = "",
                 keep: Callable[[int], bool] = lambda _n: True,
                 stamp: Stamp | None = None) -> Iterator[tuple[int, Record]]:
    """(line number, record) for every record whose line number `keep` accepts, streamed; a bad record
    (kept or not) fails with `file:line: problem`; `stamp`: what the file must still be (its `Scan`'s)."""
    for number, obj in _lines(path, stamp):
        try:
            record = parse_record(obj, fmt, text_field, why or "set by dataset.format")
        except RecordError as exc:
            raise DatasetError(f"{path}:{number}: {exc}") from None
        if keep(number):
            yield number, record


@dataclass(frozen=True)
class Scan:
    """What one validating pass over a file learnt: its format and how many records fall on each side."""

    path: Path
    format: Format
    why: str
    kept: int  # records `keep` accepted
    other: int  # records it did not
    stamp: Stamp  # the file this pass validated: later reads must find the same


def scan(path: Path, fmt: Literal["auto"] | Format, text_field: str,
         keep: Callable[[int], bool] = lambda _n: True, why: str = "") -> Scan:
    """Validate every record of `path` (a streaming pass that keeps only counts); `why`: where an explicit
    `fmt` came from, for the errors."""
    stamp = Stamp.of(path)
    resolved, why = (fmt, why) if why and fmt != "auto" else resolve_format(path, fmt, text_field)
    kept = other = 0
    for number, _ in read_records(path, resolved, text_field, why, stamp=stamp):
        if keep(number):
            kept += 1
        else:
            other += 1
    return Scan(path, resolved, why, kept, other, stamp)
