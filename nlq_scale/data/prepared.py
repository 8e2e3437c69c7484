"""Opening and checking a prepared dataset directory (see prepare.py for its layout), without
importing mosaicml-streaming.

Checks at the edge: a missing or unprepared directory, or a shard that is missing or has the wrong
size, is a UsageError naming it. Shard contents are checked against the xxh64 in index.json when a
process first reads the shard (`verify_shard`). zstd shards get their decompressed copy written
beside them once (what streaming itself would do on first read, but done here up front so that
several loaders on one node never race on the same temporary file).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from nlq_scale.data.prepare import FORMAT, MANIFEST, SPLITS
from nlq_scale.errors import UsageError

INDEX = "index.json"


class CorruptShard(UsageError):
    """A shard whose bytes do not match index.json. One line, naming the shard file."""


@dataclass(frozen=True)
class ShardFile:
    path: Path
    bytes: int
    xxh64: str


@dataclass(frozen=True)
class Shard:
    raw: ShardFile
    zip: ShardFile | None
    samples: int


@dataclass(frozen=True)
class PreparedDataset:
    path: Path
    manifest: dict
    manifest_sha256: str

    @property
    def seq_len(self) -> int:
        return int(self.manifest["options"]["seq_len"])

    @property
    def tokenizer(self) -> dict:
        return self.manifest["tokenizer"]

    def split_dir(self, split: str) -> Path:
        return self.path / split

    def shards(self, split: str) -> list[Shard]:
        index_path = self.split_dir(split) / INDEX
        try:
            index = json.loads(index_path.read_text())
            return [_shard(self.split_dir(split), s) for s in index["shards"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UsageError(f"{index_path}: unreadable MDS index ({e}); re-run nlq-scale prepare-data") from None

    def sequences(self, split: str) -> int:
        return sum(s.samples for s in self.shards(split))


def _shard(split_dir: Path, info: dict) -> Shard:
    def file(key: str) -> ShardFile | None:
        data = info.get(key)
        if not data:
            return None
        return ShardFile(split_dir / data["basename"], int(data["bytes"]), data["hashes"]["xxh64"])

    return Shard(raw=file("raw_data"), zip=file("zip_data"), samples=int(info["samples"]))


def open_prepared(path: str | Path, *, field: str = "data.path") -> PreparedDataset:
    """The dataset at `path`, after the cheap structural checks (manifest, indexes, shard sizes)."""
    root = Path(path)
    if not root.is_dir():
        raise UsageError(f"{field} {root}: no such dataset directory")
    manifest_path = root / MANIFEST
    if not manifest_path.is_file():
        raise UsageError(f"{field} {root}: not a prepared dataset (no {MANIFEST}); run nlq-scale prepare-data")
    raw = manifest_path.read_bytes()
    try:
        manifest = json.loads(raw)
    except ValueError as e:
        raise UsageError(f"{manifest_path}: not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise UsageError(f"{manifest_path}: not an nlq-scale dataset manifest (format {FORMAT} expected)")
    dataset = PreparedDataset(root, manifest, hashlib.sha256(raw).hexdigest())
    for split in SPLITS:
        if not (dataset.split_dir(split) / INDEX).is_file():
            raise UsageError(f"{field} {root}: {split}/{INDEX} missing; re-run nlq-scale prepare-data")
        for shard in dataset.shards(split):
            _check_present(shard)
    return dataset


def _has(file: ShardFile | None) -> bool:
    return file is not None and file.path.is_file() and file.path.stat().st_size == file.bytes


def _check_present(shard: Shard) -> None:
    if _has(shard.raw) or _has(shard.zip):
        return
    wanted = shard.zip if shard.zip is not None and not shard.raw.path.exists() else shard.raw
    raise UsageError(f"{wanted.path}: shard missing or truncated (expected {wanted.bytes} bytes)")


def _xxh64(data: bytes) -> str:
    from nlq_scale.compat.streaming import xxh64  # the writer's own hash; callers imported streaming

    return xxh64(data)


def verify_bytes(data: bytes, file: ShardFile) -> None:
    got = _xxh64(data)
    if got != file.xxh64:
        raise CorruptShard(
            f"{file.path}: corrupted shard (xxh64 {got}, index.json says {file.xxh64}); re-run nlq-scale prepare-data"
        )


def verify_shard(file: ShardFile) -> None:
    try:
        data = file.path.read_bytes()
    except OSError as e:
        raise CorruptShard(f"{file.path}: unreadable shard ({e.strerror or e})") from None
    verify_bytes(data, file)


def ensure_decompressed(dataset: PreparedDataset, split: str) -> None:
    """Write the raw form of every zstd shard that lacks one (checked against both hashes). A
    per-process temporary name and an atomic rename make concurrent callers safe."""
    import zstandard

    for shard in dataset.shards(split):
        if _has(shard.raw) or shard.zip is None:
            continue
        data = shard.zip.path.read_bytes()
        verify_bytes(data, shard.zip)
        try:
            raw = zstandard.ZstdDecompressor().decompress(data, max_output_size=shard.raw.bytes)
        except zstandard.ZstdError as e:
            raise CorruptShard(f"{shard.zip.path}: cannot decompress ({e})") from None
        verify_bytes(raw, shard.raw)
        tmp = shard.raw.path.with_name(f"{shard.raw.path.name}.tmp-{os.getpid()}")
        tmp.write_bytes(raw)
        tmp.replace(shard.raw.path)
