"""One dataset of a job (its `path`, or one entry of its `mix`): found, validated whole before training, and
read again for every epoch.

`DataSet` resolves the format (the spec's, or the first record's), checks every record in one streaming
pass that keeps only counts (so a bad record anywhere fails with `file:line: problem` before the first
step), and then yields `(key, where, record)` for the records on either side of the held-out split, which
depends only on (seed, record key) and so needs no pass to draw.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from memstrata.api.dataset import MixSource
from memstrata.runtime.train.data.records import DatasetError, Format, Record, RecordError, Shape, parse_record, \
    record_format
from memstrata.runtime.train.data.sources import DataFile, Row, data_files, rows

__all__ = ["DataSet", "Counts", "CONVERSATIONS"]

CONVERSATIONS = ("messages", "sharegpt", "alpaca")  # formats rendered through the chat template


@dataclass(frozen=True)
class Counts:
    kept: int  # records the split's test accepted
    other: int  # records it did not


class DataSet:
    """A source's files and records. `format`/`why`: given, or that of `inherit` (a validation set is read as
    the training set is), or that of the first record."""

    def __init__(self, spec: MixSource, field: str, inherit: DataSet | None = None) -> None:
        self.field, self.name = field, spec.path
        self.files: list[DataFile] = data_files(spec.path)
        self.shape = Shape.of(spec)
        self.format: Format
        self.why: str
        if inherit is not None:
            self.format = inherit.format
            self.why = inherit.why if spec.format != "auto" else f"{inherit.why} of {inherit.name}"
        elif spec.format != "auto":
            self.format, self.why = spec.format, f"set by {field.rsplit('.', 1)[0]}.format"
        else:
            self.format, self.why = self._first_format()

    def _rows(self) -> Iterator[Row]:
        for index, file in enumerate(self.files):
            yield from rows(file, index)

    def _first_format(self) -> tuple[Format, str]:
        for row in self._rows():
            if not isinstance(row.value, dict):
                raise DatasetError(f"{row.where}: expected a JSON object, got {type(row.value).__name__}")
            own = record_format(row.value, self.shape)
            if own is None:
                raise DatasetError(
                    f"{row.where}: no {self.shape.text!r}, 'prompt'/'completion', 'messages', ShareGPT "
                    f"('conversations') or Alpaca ('instruction'/'output') field: cannot tell the dataset's format "
                    f"(set {self.field.rsplit('.', 1)[0]}.format, textField or columns); its fields: "
                    f"{', '.join(sorted(row.value)) or 'none'}")
            return own, f"that of {_line(row.where)}"
        raise DatasetError(f"{self.name}: holds no records")

    def records(self, keep: Callable[[int], bool] = lambda _k: True) -> Iterator[tuple[int, str, Record]]:
        """(key, where, record) of every record `keep` accepts, streamed; a bad record (kept or not) fails with
        `file:line: problem`."""
        for row in self._rows():
            try:
                record = parse_record(row.value, self.format, self.shape, self.why)
            except RecordError as exc:
                raise DatasetError(f"{row.where}: {exc}") from None
            if keep(row.key):
                yield row.key, row.where, record

    def scan(self, keep: Callable[[int], bool] = lambda _k: True) -> Counts:
        """Validate every record (a streaming pass that keeps only counts)."""
        kept = other = 0
        for key, _, _ in self.records():
            if keep(key):
                kept += 1
            else:
                other += 1
        if not kept + other:
            raise DatasetError(f"{self.name}: holds no records")
        return Counts(kept, other)

    @property
    def conversation(self) -> bool:
        return self.format in CONVERSATIONS


def _line(where: str) -> str:
    """`file:4` -> `line 4`; `file:row 4` -> `row 4` (how the format's origin is told)."""
    tail = where.rsplit(":", 1)[1]
    return tail if tail.startswith("row") else f"line {tail}"
