"""Where a dataset's records come from: the files a path names, and each file's rows, streamed.

A path is a file, a glob, a directory of data files (read in sorted order), or a directory that `datasets`'
`save_to_disk` wrote (its train split). Two readers, one per family of formats, each the one that can say
where a problem is:

- JSON (JSON Lines or one JSON array; any compression fsspec infers from the name: `.gz`, `.bz2`, `.xz`,
  `.zst`): read here, line by line, so a bad record is reported as `file:line`. A JSON array cannot be
  streamed and is read whole (use JSON Lines for large sets).
- Parquet, CSV and Arrow files and `save_to_disk` directories (Arrow streams listed in its state.json): through
  pyarrow, streamed a batch of rows at a time (Parquet: one row group at a time; Arrow: memory-mapped), rows
  numbered from 1 (`file:row N`). pyarrow is the one library this adds to the runtime image (about 130 MB
  installed); `datasets` itself, with pandas and its cache, is not needed to read what it wrote.

Every file is read again for every epoch, so it must stay what the validating pass saw: a `Stamp` (device,
inode, size, modification time of each file) is taken when the source is opened and checked when each file
is opened and when its end is reached, so a file emptied or edited under a run fails naming it.
"""
from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from memstrata.api.dataset import glob_files
from memstrata.runtime.train.data.records import DatasetError

__all__ = ["DataFile", "Row", "Stamp", "data_files", "rows"]

Kind = Literal["json", "parquet", "csv", "arrow", "saved"]
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")
KINDS: dict[str, Kind] = {".jsonl": "json", ".json": "json", ".ndjson": "json", ".parquet": "parquet",
                          ".csv": "csv", ".arrow": "arrow"}
SAVED_MARKERS = ("state.json", "dataset_dict.json")
BATCH_ROWS = 1024  # rows converted to Python at a time from a columnar file
FILE_BITS = 40  # a row's key: file index above these bits, row number below (the held-out split hashes it)


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


@dataclass(frozen=True)
class DataFile:
    """One file (or saved dataset directory) of a source, and the stamps of what it is made of."""

    path: Path
    kind: Kind
    stamps: tuple[tuple[Path, Stamp], ...]

    def check(self) -> None:
        for path, stamp in self.stamps:
            stamp.check(path)


@dataclass(frozen=True)
class Row:
    key: int  # unique within a source: (file index << FILE_BITS) + row or line number
    where: str  # `file:line` or `file:row N`, for errors
    value: object


def _kind(path: Path) -> Kind | None:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in COMPRESSIONS:
        suffixes.pop()
    return KINDS.get(suffixes[-1]) if suffixes else None


def _data_file(path: Path, kind: Kind) -> DataFile:
    if kind in ("parquet", "arrow") and path.suffix.lower() in COMPRESSIONS:
        raise DatasetError(f"{path}: a compressed {kind} file cannot be read a batch at a time (its format "
                           "compresses itself): decompress it")
    parts = sorted(p for p in path.rglob("*") if p.is_file()) if kind == "saved" else [path]
    return DataFile(path, kind, tuple((p, Stamp.of(p)) for p in parts))


def data_files(path: str) -> list[DataFile]:
    """The files `path` names, in the order they are read; fails naming the path when it names none."""
    matched = glob_files(path)
    if matched is not None:
        if not matched:
            raise DatasetError(f"{path}: matches no file")
        return [_data_file(p, _kind(p) or "json") for p in matched]
    root = Path(path)
    if not root.is_dir():
        Stamp.of(root)  # a missing or unreadable file fails here, naming it
        return [_data_file(root, _kind(root) or _sniffed(root))]
    if any((root / marker).is_file() for marker in SAVED_MARKERS):
        return [_data_file(root, "saved")]
    found = sorted(p for p in root.rglob("*") if p.is_file() and _kind(p) is not None
                   and not any(part.startswith(".") for part in p.relative_to(root).parts))
    if not found:
        raise DatasetError(f"{root}: a directory with no data files (expected *.jsonl, *.json, *.parquet, *.csv or "
                           "*.arrow, possibly compressed) and not a save_to_disk directory (no state.json)")
    return [_data_file(p, _kind(p) or "json") for p in found]


def _sniffed(path: Path) -> Kind:
    """The kind of a file whose name does not say: Parquet by its magic bytes, else JSON."""
    try:
        with path.open("rb") as handle:
            return "parquet" if handle.read(4) == b"PAR1" else "json"
    except OSError as exc:
        raise DatasetError(f"{path}: cannot read: {exc.strerror or exc}") from None


def rows(file: DataFile, index: int) -> Iterator[Row]:
    """Every row of `file` (the `index`-th of its source), streamed; checks its stamps at both ends."""
    file.check()
    base = index << FILE_BITS
    if file.kind == "json":
        for number, where, value in _json_rows(file.path):
            yield Row(base + number, where, value)
    else:
        for number, value in enumerate(_table_rows(file), 1):
            yield Row(base + number, f"{file.path}:row {number}", value)
    file.check()


def _json_rows(path: Path) -> Iterator[tuple[int, str, object]]:
    import fsspec

    try:
        handle = fsspec.open(str(path), "rb", compression="infer").open()
    except (OSError, ValueError) as exc:
        raise DatasetError(f"{path}: cannot read: {exc}") from None
    # Peeked, not read and rewound: a zstd stream cannot seek backwards.
    with io.BufferedReader(handle, buffer_size=1 << 16) as buffered:
        if buffered.peek(1 << 16).lstrip().startswith(b"["):
            yield from _json_array(path, buffered.read())
            return
        for number, raw in enumerate(buffered, 1):  # bytes, decoded per line, so a bad byte names its line
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DatasetError(f"{path}:{number}: not UTF-8 text: {exc.reason} at byte {exc.start}") from None
            if not line.strip():
                continue
            try:
                yield number, f"{path}:{number}", json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path}:{number}: malformed JSON: {exc.msg} (column {exc.colno})") from None


def _json_array(path: Path, data: bytes) -> Iterator[tuple[int, str, object]]:
    try:
        items = json.loads(data)
    except UnicodeDecodeError as exc:
        raise DatasetError(f"{path}: not UTF-8 text: {exc.reason} at byte {exc.start}") from None
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{path}:{exc.lineno}: malformed JSON: {exc.msg} (column {exc.colno})") from None
    for number, item in enumerate(items, 1):
        yield number, f"{path}:row {number}", item


def _table_rows(file: DataFile) -> Iterator[dict[str, Any]]:
    try:
        for batch in _batches(file):
            yield from batch.to_pylist()
    except DatasetError:
        raise
    except Exception as exc:  # pyarrow's errors for a file that is not what its name says
        raise DatasetError(f"{file.path}: cannot be read as {file.kind}: {type(exc).__name__}: {exc}") from None


def _batches(file: DataFile) -> Iterator[Any]:
    """The file's record batches, at most `BATCH_ROWS` rows each (a Parquet file: one row group at a time)."""
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    if file.kind == "parquet":
        yield from pq.ParquetFile(file.path).iter_batches(batch_size=BATCH_ROWS, use_threads=False)
    elif file.kind == "csv":
        import fsspec

        # Every column as text: a CSV cell is text, and inferring numbers would turn "1.50" into 1.5. Decompressed
        # as JSON is (fsspec, by the name), the header read past a byte-order mark.
        with fsspec.open(str(file.path), "rt", compression="infer", encoding="utf-8-sig", newline="") as head:
            names = next(csv.reader(head), [])
        options = pacsv.ConvertOptions(column_types={name: pa.string() for name in names})
        with fsspec.open(str(file.path), "rb", compression="infer") as raw:
            yield from pacsv.open_csv(raw, convert_options=options)
    elif file.kind == "arrow":
        yield from _ipc(file.path)
    else:
        for part in _saved_parts(file.path):
            yield from _ipc(part)


def _ipc(path: Path) -> Iterator[Any]:
    """An Arrow IPC file or stream (`save_to_disk` writes streams), memory-mapped."""
    import pyarrow as pa

    with pa.memory_map(str(path)) as source:
        try:
            reader = pa.ipc.open_file(source)
            batches: Iterator[Any] = (reader.get_batch(i) for i in range(reader.num_record_batches))
        except pa.ArrowInvalid:
            source.seek(0)
            batches = iter(pa.ipc.open_stream(source))
        for batch in batches:
            for start in range(0, batch.num_rows, BATCH_ROWS):
                yield batch.slice(start, BATCH_ROWS)


def _saved_parts(root: Path) -> list[Path]:
    """The Arrow files of a `save_to_disk` directory (its train split, for a DatasetDict), in order."""
    if (root / "dataset_dict.json").is_file():
        splits = json.loads((root / "dataset_dict.json").read_text()).get("splits", [])
        if "train" not in splits:
            raise DatasetError(f"{root}: a saved DatasetDict without a train split (it has {', '.join(splits)}): "
                               "point dataset.path at the split's directory")
        root = root / "train"
    state = json.loads((root / "state.json").read_text())
    try:
        return [root / entry["filename"] for entry in state["_data_files"]]
    except (KeyError, TypeError):
        raise DatasetError(f"{root / 'state.json'}: lists no data files: not a save_to_disk directory's") from None
