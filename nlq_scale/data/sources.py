"""Streamed readers for the real distribution formats of the corpora.

Every reader yields records in file order without holding the corpus in memory:
`Document` (a text to tokenize), `Bad` (a document or file part that cannot be used, with where and
why) or `Filtered` (a Pile document outside the requested `pile_set_name`s). The raw bytes of each
input are hashed while they stream past, so the manifest's sha256 costs no second read.

Formats:
- OpenWebText: Hugging Face parquet shards (a `text` column), or the original `openwebtext.tar.xz`
  holding `urlsf_subset*.xz` tars of `.txt` files (nested tars are walked, streamed `r|*`).
- The Pile: `*.jsonl.zst` with `{"text": ..., "meta": {"pile_set_name": ...}}`, zstd frames without
  a content size, decoded frame by frame so a truncated file is detected.
- `.txt` files (one document per file) and `.jsonl` / `.jsonl.zst` with a configurable text field.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import lzma
import tarfile
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Literal

from nlq_scale.errors import UsageError

Source = Literal["openwebtext", "pile", "text", "jsonl"]
SOURCES: tuple[str, ...] = ("openwebtext", "pile", "text", "jsonl")
SUFFIXES: dict[str, tuple[str, ...]] = {
    "openwebtext": (".parquet", ".tar.xz", ".xz", ".tar"),
    "pile": (".jsonl.zst", ".jsonl"),
    "text": (".txt",),
    "jsonl": (".jsonl", ".jsonl.zst"),
}
NESTED_ARCHIVE_SUFFIXES = (".xz", ".tar", ".tgz", ".gz")
# Also the grain of a record's position in a file (InputFile.consumed), by which --part splits one file.
READ_BYTES = 1 << 18
# The Pile was compressed with long-distance matching: windows up to 2 GiB.
ZSTD_MAX_WINDOW = 2**31
PARQUET_BATCH_ROWS = 1024


@dataclass(frozen=True)
class Document:
    text: str
    where: str


@dataclass(frozen=True)
class Bad:
    where: str
    kind: str  # empty | not_utf8 | invalid_json | missing_field | truncated | corrupt | unexpected_member
    detail: str


@dataclass(frozen=True)
class Filtered:
    where: str
    group: str


@dataclass(frozen=True)
class Unread:
    """A JSON line before `InputFile.start`: another part's, so not even parsed."""


UNREAD = Unread()
Record = Document | Bad | Filtered | Unread


@dataclass(frozen=True)
class SourceSpec:
    source: Source
    text_field: str = "text"
    pile_sets: frozenset[str] | None = None


@dataclass(frozen=True)
class FileDigest:
    bytes: int
    sha256: str


def _matches(path: Path, source: str) -> bool:
    return path.name.endswith(SUFFIXES[source])


def expand_inputs(source: str, paths: Iterable[str | Path]) -> list[Path]:
    """Files named or found (recursively) under directories, in sorted path order, so the token
    stream does not depend on the order the inputs were listed in."""
    found: set[Path] = set()
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            hits = {p.resolve() for p in path.rglob("*") if p.is_file() and _matches(p, source)}
            if not hits:
                raise UsageError(f"--input {path}: no {'/'.join(SUFFIXES[source])} files for --source {source}")
            found |= hits
        elif path.is_file():
            if not _matches(path, source):
                raise UsageError(
                    f"--input {path}: not a --source {source} file (expected {', '.join(SUFFIXES[source])})"
                )
            found.add(path.resolve())
        else:
            raise UsageError(f"--input {path}: no such file or directory")
    return sorted(found, key=str)


class HashingReader(io.RawIOBase):
    """A read-only view of a binary file that hashes every byte read through it."""

    def __init__(self, raw: BinaryIO) -> None:
        self._raw = raw
        self._sha = hashlib.sha256()
        self._bytes = 0

    def readable(self) -> bool:
        return True

    @property
    def bytes_read(self) -> int:
        return self._bytes

    def readinto(self, buffer) -> int:  # type: ignore[override]
        n = self._raw.readinto(buffer)
        if n:
            self._sha.update(memoryview(buffer)[:n])
            self._bytes += n
        return n or 0

    def drain(self) -> FileDigest:
        """Read what the decoder left (trailing padding, or everything after a skipped truncation)."""
        while self.read(READ_BYTES):
            pass
        return FileDigest(self._bytes, self._sha.hexdigest())


def sha256_file(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def file_digest(path: Path) -> FileDigest:
    return FileDigest(path.stat().st_size, sha256_file(path))


def _text_record(text: str, where: str) -> Record:
    if not text.strip():
        return Bad(where, "empty", "empty document")
    return Document(text, where)


def _decode(data: bytes, where: str) -> Record:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        return Bad(where, "not_utf8", f"not valid UTF-8 (byte {e.start})")
    return _text_record(text, where)


# ---- tar / tar.xz (OpenWebText) ---------------------------------------------------------------


def _decompressed(fileobj: BinaryIO, name: str) -> BinaryIO:
    if name.endswith(".xz"):
        return lzma.LZMAFile(fileobj)
    if name.endswith((".gz", ".tgz")):
        return gzip.GzipFile(fileobj=fileobj)
    return fileobj


def _tar_records(fileobj: BinaryIO, where: str) -> Iterator[Record]:
    """Documents of a (compressed) tar, streamed; nested tars are walked. tarfile stops quietly at a
    header cut short, so the compressed stream is read to its end afterwards: a truncated xz/gzip
    stream raises there."""
    stream = _decompressed(fileobj, where)
    try:
        with tarfile.open(fileobj=stream, mode="r|") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                inner = f"{where}!{member.name}"
                data = tar.extractfile(member)
                if member.name.endswith(".txt"):
                    yield _decode(data.read(), inner)
                elif member.name.endswith(NESTED_ARCHIVE_SUFFIXES):
                    yield from _tar_records(data, inner)
                else:
                    yield Bad(inner, "unexpected_member", "neither a .txt document nor a nested tar")
        while stream.read(READ_BYTES):
            pass
    except (tarfile.TarError, EOFError, lzma.LZMAError, zlib.error, gzip.BadGzipFile, OSError) as e:
        yield Bad(where, "truncated", f"truncated or corrupt archive ({e})")


# ---- jsonl / jsonl.zst (The Pile) -------------------------------------------------------------


class TruncatedStream(Exception):
    pass


def _zstd_chunks(raw: BinaryIO) -> Iterator[bytes]:
    """Decompressed bytes of every frame in turn. zstandard's stream_reader quietly returns a short
    read for a truncated file; a frame that never reaches its end is reported here instead."""
    import zstandard

    decompressor = zstandard.ZstdDecompressor(max_window_size=ZSTD_MAX_WINDOW)
    frame = decompressor.decompressobj()
    inside_frame = False
    while chunk := raw.read(READ_BYTES):
        while chunk:
            inside_frame = True
            out = frame.decompress(chunk)
            if out:
                yield out
            if frame.eof:
                chunk = frame.unused_data
                frame = decompressor.decompressobj()
                inside_frame = False
            else:
                chunk = b""
    if inside_frame:
        raise TruncatedStream("zstd stream ends inside a frame")


def _plain_chunks(raw: BinaryIO) -> Iterator[bytes]:
    while chunk := raw.read(READ_BYTES):
        yield chunk


def _lines(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """Complete lines; a last line without a newline is still a line."""
    pending = b""
    for chunk in chunks:
        parts = (pending + chunk).split(b"\n")
        pending = parts.pop()
        yield from parts
    if pending:
        yield pending


def _field(obj: dict, dotted: str) -> object:
    node: object = obj
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def _json_record(line: bytes, where: str, spec: SourceSpec) -> Record:
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        return Bad(where, "not_utf8", f"not valid UTF-8 (byte {e.start})")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return Bad(where, "invalid_json", f"invalid JSON ({e.msg} at column {e.colno})")
    if not isinstance(obj, dict):
        return Bad(where, "invalid_json", "a JSON line must be an object")
    if spec.pile_sets is not None:
        group = _field(obj, "meta.pile_set_name")
        group = group if isinstance(group, str) else "(none)"
        if group not in spec.pile_sets:
            return Filtered(where, group)
    value = _field(obj, spec.text_field)
    if not isinstance(value, str):
        detail = "missing" if value is None else f"a {type(value).__name__}, not a string"
        return Bad(where, "missing_field", f"text field {spec.text_field!r} is {detail}")
    return _text_record(value, where)


def _jsonl_records(raw: BinaryIO, path: Path, spec: SourceSpec, wanted: Callable[[], bool]) -> Iterator[Record]:
    import zstandard

    chunks = _zstd_chunks(raw) if path.name.endswith(".zst") else _plain_chunks(raw)
    number = 0
    try:
        for number, line in enumerate(_lines(chunks), start=1):
            if line.strip():
                yield _json_record(line, f"{path}:{number}", spec) if wanted() else UNREAD
    except TruncatedStream as e:
        yield Bad(f"{path}:{number + 1}", "truncated", f"{e} (truncated file?)")
    except zstandard.ZstdError as e:
        yield Bad(f"{path}:{number + 1}", "corrupt", f"corrupt zstd data ({e})")


# ---- parquet (OpenWebText on the Hugging Face hub) --------------------------------------------


def _parquet_records(path: Path, spec: SourceSpec) -> Iterator[Record]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        yield Bad(str(path), "corrupt", f"not a readable parquet file ({e})")
        return
    if spec.text_field not in pf.schema_arrow.names:
        raise UsageError(f"{path}: no {spec.text_field!r} column (columns: {', '.join(pf.schema_arrow.names)})")
    row = 0
    try:
        for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[spec.text_field]):
            for value in batch.column(0).to_pylist():
                where = f"{path}:row {row}"
                row += 1
                if isinstance(value, bytes):
                    yield _decode(value, where)
                elif isinstance(value, str):
                    yield _text_record(value, where)
                else:
                    yield Bad(where, "missing_field", f"{spec.text_field!r} is null")
    except (pa.ArrowException, OSError) as e:
        yield Bad(f"{path}:row {row}", "truncated", f"truncated or corrupt parquet ({e})")


def _parquet_rows(path: Path) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path).metadata.num_rows
    except (pa.ArrowException, OSError):
        return 0  # _parquet_records reports the file as corrupt


class InputFile:
    """One input: iterate it for its records; afterwards `digest` holds its size and sha256."""

    def __init__(self, path: Path, spec: SourceSpec) -> None:
        self.path = path
        self.spec = spec
        self.size = path.stat().st_size
        self.digest: FileDigest | None = None
        self.start = 0
        self._consumed = lambda: 0

    @property
    def consumed(self) -> int:
        """How far into the file the reader has got, in bytes of the file: the bytes read so far,
        or for parquet the share of the rows read. It depends on the file alone, so processes
        reading the same file agree on where each record lies (`prepare-data --part`)."""
        return self._consumed()

    @property
    def position(self) -> int:
        """Where in the file the record just yielded lies, in [0, size): consumed - 1. JSON lines
        before `start` (another part's) are yielded as UNREAD, without parsing."""
        return max(self.consumed - 1, 0)

    def __iter__(self) -> Iterator[Record]:
        if self.path.name.endswith(".parquet"):
            rows, done = _parquet_rows(self.path), 0
            self._consumed = lambda: self.size * done // rows if rows and done < rows else self.size
            for record in _parquet_records(self.path, self.spec):
                done += 1
                yield record
            self.digest = file_digest(self.path)
            return
        with self.path.open("rb", buffering=0) as fh:
            raw = HashingReader(fh)
            self._consumed = lambda: raw.bytes_read
            if self.path.name.endswith(".txt"):
                yield _decode(raw.read(), str(self.path))
            elif ".jsonl" in self.path.name:
                yield from _jsonl_records(raw, self.path, self.spec, lambda: self.position >= self.start)
            else:
                yield from _tar_records(raw, str(self.path))
            self.digest = raw.drain()
