"""Raw corpus -> GPT-2 tokens -> fixed windows of seq_len+1 tokens -> MDS shards + manifest.json.

Output layout (what the loader reads):
    DIR/manifest.json      inputs, tokenizer, options, per-split counts, shard hashes, skipped docs
    DIR/train/index.json   mosaicml-streaming MDS, one column `tokens` = uint16[seq_len + 1]
    DIR/val/index.json

Determinism: inputs are read in sorted path order; documents are tokenized in parallel but consumed
in order; each document goes to val or train by a hash of its text alone (never by position, worker
count or file order); documents are joined with EOT and cut into windows. The same inputs and
options therefore give byte-identical shards and manifest. Everything is written into a staging
directory beside DIR and renamed into place at the end, so a failed run leaves nothing that looks
complete.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import os
import shutil
import socket
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator

from nlq_scale.data.sources import (
    Bad, Document, Filtered, InputFile, Record, Source, SourceSpec, expand_inputs,
)
from nlq_scale.data.tokenizer import Tokenizer, gpt2_tokenizer
from nlq_scale.errors import UsageError

MANIFEST = "manifest.json"
FORMAT = "nlq-scale-mds/1"
SPLITS = ("train", "val")
DEFAULT_VAL_FRACTION = 0.0005  # nanoGPT's OpenWebText split
CHUNK_DOCS = 256
CHUNK_CHARS = 4 << 20
SKIPPED_LISTED = 1000
HASH_SPACE = 1 << 64


class PrepareOptions(BaseModel):
    """What `nlq-scale prepare-data` was asked to do. Everything except `workers`, `force` and
    `progress` is recorded in the manifest, because it shapes the output."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: Source
    inputs: list[Path] = Field(min_length=1)
    out: Path
    seq_len: PositiveInt = 1024
    val_fraction: float | None = Field(None, ge=0.0, lt=1.0)
    val_docs: int | None = Field(None, ge=0)
    workers: PositiveInt = Field(default_factory=lambda: os.cpu_count() or 1)
    force: bool = False
    skip_bad: bool = False
    text_field: str = "text"
    pile_sets: list[str] | None = None
    compression: Literal["none", "zstd"] = "none"
    shard_bytes: PositiveInt = 1 << 26

    @model_validator(mode="after")
    def _check(self) -> PrepareOptions:
        if self.val_fraction is not None and self.val_docs is not None:
            raise ValueError("give --val-docs or --val-fraction, not both")
        if self.pile_sets is not None and self.source not in ("pile", "jsonl"):
            raise ValueError("--pile-sets applies to --source pile or jsonl only")
        if self.shard_bytes < 4 * self.window_bytes:
            raise ValueError(f"--shard-size must be at least 4 sequences ({4 * self.window_bytes} bytes)")
        if self.shard_bytes >= 1 << 32:
            raise ValueError("--shard-size must be below 4 GiB (MDS stores uint32 offsets)")
        return self

    @property
    def window(self) -> int:
        return self.seq_len + 1

    @property
    def window_bytes(self) -> int:
        return 2 * self.window

    @property
    def val_rule(self) -> dict:
        if self.val_docs is not None:
            return {"docs": self.val_docs}
        return {"fraction": DEFAULT_VAL_FRACTION if self.val_fraction is None else self.val_fraction}

    def spec(self) -> SourceSpec:
        sets = frozenset(self.pile_sets) if self.pile_sets is not None else None
        return SourceSpec(self.source, self.text_field if self.source != "pile" else "text", sets)

    def recorded(self) -> dict:
        spec = self.spec()
        return {
            "source": self.source,
            "seq_len": self.seq_len,
            "val": self.val_rule,
            "text_field": spec.text_field if self.source in ("pile", "jsonl") else None,
            "pile_sets": sorted(spec.pile_sets) if spec.pile_sets is not None else None,
            "skip_bad": self.skip_bad,
            "compression": self.compression,
            "shard_bytes": self.shard_bytes,
        }


# ---- packing ----------------------------------------------------------------------------------


@dataclass
class SplitStats:
    documents: int = 0
    tokens: int = 0
    sequences: int = 0
    dropped_tail_tokens: int = 0


class Packer:
    """Joins documents (each already ending in EOT) and emits every full window of tokens."""

    def __init__(self, window: int, emit: Callable[[np.ndarray], None]) -> None:
        self.window = window
        self.emit = emit
        self.stats = SplitStats()
        self._parts: list[np.ndarray] = []
        self._pending = 0

    def add(self, tokens: np.ndarray) -> None:
        self.stats.documents += 1
        self.stats.tokens += len(tokens)
        self._parts.append(tokens)
        self._pending += len(tokens)
        if self._pending >= self.window:
            joined = np.concatenate(self._parts)
            full = len(joined) // self.window
            for i in range(full):
                self.emit(joined[i * self.window : (i + 1) * self.window])
            self.stats.sequences += full
            rest = joined[full * self.window :]
            self._parts = [rest] if len(rest) else []
            self._pending = len(rest)

    def finish(self) -> SplitStats:
        self.stats.dropped_tail_tokens = self._pending
        self._parts, self._pending = [], 0
        return self.stats


def doc_key(text: str) -> int:
    """The document's place in [0, 2^64): a hash of its text, so the val split is a property of
    the document, not of where or when it was read."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "big")


def val_threshold(rule: dict) -> int:
    """With a `fraction` rule: a document goes to val iff its key is below this."""
    return int(rule.get("fraction", 0.0) * HASH_SPACE)


class Splitter:
    """Routes each document to val or train. `fraction`: val iff key < fraction * 2^64.
    `docs`: val = the N documents with the smallest keys (held in memory until the end; a document
    pushed out of the N smallest goes to train at that moment)."""

    def __init__(self, rule: dict, train: Packer, val: Packer) -> None:
        self.train, self.val = train, val
        self.quota = rule.get("docs")
        self.threshold = val_threshold(rule)
        self._heap: list[tuple[int, int, np.ndarray]] = []  # (-key, -index, tokens): max-heap
        self._index = 0

    def add(self, key: int, tokens: np.ndarray) -> None:
        self._index += 1
        if self.quota is None:
            (self.val if key < self.threshold else self.train).add(tokens)
            return
        entry = (-key, -self._index, tokens)
        if len(self._heap) < self.quota:
            heapq.heappush(self._heap, entry)
        elif self.quota and entry > self._heap[0]:
            self.train.add(heapq.heappushpop(self._heap, entry)[2])
        else:
            self.train.add(tokens)

    def finish(self) -> None:
        for _, _, tokens in sorted(self._heap, reverse=True):
            self.val.add(tokens)
        self._heap = []


# ---- reading, checking and tokenizing in order ------------------------------------------------


@dataclass
class Skips:
    skip_bad: bool
    by_kind: Counter = field(default_factory=Counter)
    listed: list[dict] = field(default_factory=list)
    filtered: Counter = field(default_factory=Counter)

    def bad(self, record: Bad) -> None:
        if not self.skip_bad:
            raise UsageError(f"{record.where}: {record.detail} (pass --skip-bad to skip and count such input)")
        self.by_kind[record.kind] += 1
        if len(self.listed) < SKIPPED_LISTED:
            self.listed.append({"where": record.where, "kind": record.kind, "detail": record.detail})

    def state(self) -> dict:
        return {"by_kind": dict(self.by_kind), "listed": self.listed, "filtered": dict(self.filtered)}

    def add(self, state: dict) -> None:
        """The counts of the next stretch of the inputs (a part's `state()`) after these."""
        self.by_kind.update(state["by_kind"])
        self.filtered.update(state["filtered"])
        self.listed += state["listed"][: SKIPPED_LISTED - len(self.listed)]

    def describe(self) -> dict:
        total = sum(self.by_kind.values())
        return {
            "skipped": {"count": total, "by_kind": dict(sorted(self.by_kind.items())), "listed": self.listed},
            "filtered": {"count": sum(self.filtered.values()), "by_pile_set": dict(sorted(self.filtered.items()))},
        }


@dataclass(frozen=True)
class Span:
    """A stretch of the inputs laid end to end on one byte line (each file's bytes after the
    previous file's; an empty file counts 1 byte): the records whose position lies in
    [start, end). A record's position is its file's offset plus how far the reader had got into
    the file when it yielded the record (minus one), so the spans of `--part 1/N ... N/N` cut the
    record stream into N consecutive pieces, inside files too."""

    start: int
    end: int


def file_offsets(files: list[InputFile]) -> list[int]:
    """Each file's first position on the byte line, then the line's end."""
    return [0, *np.cumsum([max(f.size, 1) for f in files]).tolist()]


def _records(files: list[InputFile], span: Span | None) -> Iterator[Record]:
    offsets = file_offsets(files)
    for f, first, end in zip(files, offsets, offsets[1:]):
        if span is not None and (end <= span.start or first >= span.end):
            continue
        f.start = 0 if span is None else max(span.start - first, 0)
        for record in f:
            position = first + f.position
            if span is not None and position >= span.end:
                break  # the rest belongs to later parts: the file is closed unread from here
            if span is None or position >= span.start:
                yield record


def _documents(files: list[InputFile], skips: Skips, span: Span | None = None) -> Iterator[str]:
    for record in _records(files, span):
        if isinstance(record, Document):
            yield record.text
        elif isinstance(record, Filtered):
            skips.filtered[record.group] += 1
        else:
            skips.bad(record)


def _chunks(texts: Iterator[str]) -> Iterator[list[str]]:
    chunk: list[str] = []
    chars = 0
    for text in texts:
        chunk.append(text)
        chars += len(text)
        if len(chunk) >= CHUNK_DOCS or chars >= CHUNK_CHARS:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def _tokenize_chunk(tokenizer: Tokenizer, texts: list[str]) -> list[tuple[int, np.ndarray]]:
    return list(zip((doc_key(t) for t in texts), tokenizer.encode_documents(texts)))


def tokenized(texts: Iterable[str], tokenizer: Tokenizer, workers: int) -> Iterator[tuple[int, np.ndarray]]:
    """(key, tokens + EOT) per document, in input order. tiktoken and hashlib release the GIL, so a
    thread pool uses every core without copying text to other processes; at most 2 chunks per
    worker are in flight to bound memory."""
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tokenize") as pool:
        pending: deque[Future] = deque()
        for chunk in _chunks(iter(texts)):
            pending.append(pool.submit(_tokenize_chunk, tokenizer, chunk))
            if len(pending) >= 2 * workers:
                yield from pending.popleft().result()
        while pending:
            yield from pending.popleft().result()


# ---- output directory -------------------------------------------------------------------------


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _staging_dir(out: Path) -> Path:
    """`.<name>.partial-<host>-<pid>` beside DIR (same file system, so the final rename is
    atomic); partial directories of dead earlier runs on this host are removed first."""
    out.parent.mkdir(parents=True, exist_ok=True)
    mine = f".{out.name}.partial-{socket.gethostname().split('.')[0]}-"
    for stale in out.parent.glob(f"{mine}*"):
        pid = stale.name[len(mine) :]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    staging = out.parent / f"{mine}{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    return staging


def _inputs_brief(manifest: dict) -> list[tuple[str, int]]:
    return [(i["name"], i["bytes"]) for i in manifest.get("inputs", [])]


def planned_inputs(files: list[InputFile]) -> list[tuple[str, int]]:
    return [(f.path.name, f.size) for f in files]


def check_out_dir(opts: PrepareOptions, planned: list[tuple[str, int]]) -> None:
    """Refuse early to replace something that is not a prepared dataset, or (without --force) a
    dataset made from other inputs or options."""
    out = opts.out
    if not out.exists():
        return
    if not out.is_dir():
        raise UsageError(f"--out {out}: exists and is not a directory")
    if not any(out.iterdir()):
        return
    manifest_path = out / MANIFEST
    if not manifest_path.is_file():
        raise UsageError(f"--out {out}: exists and is not a prepared dataset (no {MANIFEST}); refusing to write into it")
    if opts.force:
        return
    try:
        existing = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"{manifest_path}: unreadable ({e}); pass --force to replace the dataset") from None
    if existing.get("options") != opts.recorded() or _inputs_brief(existing) != planned:
        raise UsageError(f"--out {out}: holds a different prepared dataset; pass --force to replace it")


def _publish(staging: Path, out: Path, force: bool) -> str:
    if not out.exists() or not any(out.iterdir()):
        if out.exists():
            out.rmdir()
        staging.rename(out)
        return "created"
    if (out / MANIFEST).read_bytes() == (staging / MANIFEST).read_bytes():
        shutil.rmtree(staging)
        return "unchanged"
    if not force:
        raise UsageError(f"--out {out}: holds a different prepared dataset (input contents differ); pass --force")
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    out.rename(old)
    staging.rename(out)
    shutil.rmtree(old)
    return "replaced"


# ---- the whole run ----------------------------------------------------------------------------


def _shard_list(split_dir: Path, split: str) -> list[dict]:
    index = json.loads((split_dir / "index.json").read_text())
    shards = []
    for shard in index["shards"]:
        entry = {"samples": shard["samples"]}
        for key in ("raw_data", "zip_data"):
            info = shard.get(key)
            if info:
                entry[key] = {"file": f"{split}/{info['basename']}", "bytes": info["bytes"], "xxh64": info["hashes"]["xxh64"]}
        shards.append(entry)
    return shards


def counted(documents: Iterable[tuple[int, np.ndarray]], progress: bool) -> Iterator[tuple[int, np.ndarray]]:
    """The tokenized documents passed through, behind a progress bar (documents, tokens/s)."""
    from tqdm import tqdm

    started = time.perf_counter()
    tokens = 0
    with tqdm(unit=" docs", unit_scale=True, disable=not progress, desc="prepare-data", mininterval=1.0) as bar:
        for key, ids in documents:
            yield key, ids
            tokens += len(ids)
            bar.update(1)
            if bar.n % CHUNK_DOCS == 0:
                bar.set_postfix_str(f"{tokens / max(time.perf_counter() - started, 1e-9):,.0f} tokens/s", refresh=False)


def mds_writer(opts: PrepareOptions, out: Path):
    from nlq_scale.compat.streaming import MDSWriter

    compression = None if opts.compression == "none" else opts.compression
    return MDSWriter(out=str(out), columns={"tokens": f"ndarray:uint16:{opts.window}"}, compression=compression,
                     hashes=["xxh64"], size_limit=opts.shard_bytes)


def window_writer(writer) -> Callable[[np.ndarray], None]:
    """Writes one window as a sample of `mds_writer`'s column. The column's fixed-shape uint16
    encoding is the array's little-endian bytes, and MDS writes bytes given for a column as they
    are: handing them over skips streaming's per-sample encoder lookup, two thirds of a merge's time."""
    return lambda window: writer.write({"tokens": window.astype("<u2", copy=False).tobytes()})


def write_splits(opts: PrepareOptions, documents: Iterable[tuple[int, np.ndarray]], staging: Path) -> dict[str, SplitStats]:
    """Route, pack and write `documents` ((key, tokens) in input order) into staging/{train,val}."""
    writers = {split: mds_writer(opts, staging / split) for split in SPLITS}
    packers = {split: Packer(opts.window, window_writer(writers[split])) for split in SPLITS}
    splitter = Splitter(opts.val_rule, packers["train"], packers["val"])
    for key, ids in documents:
        splitter.add(key, ids)
    splitter.finish()
    for writer in writers.values():
        writer.finish()
    return {split: packers[split].finish() for split in SPLITS}


def input_entry(f: InputFile) -> dict:
    """The manifest's record of an input; its digest exists once the file was read to its end."""
    return {"name": f.path.name, "bytes": f.digest.bytes, "sha256": f.digest.sha256}


def build_dataset(opts: PrepareOptions, write: Callable[[Path], dict[str, SplitStats]],
                  inputs: Callable[[], list[dict]], skips: Skips, tokenizer: dict) -> dict:
    """`write` the splits into a staging directory, add the manifest and put the dataset in place;
    `inputs` and `skips` are read once the splits are written. Returns a summary: the manifest's
    counts and what happened to DIR."""
    staging = _staging_dir(opts.out)
    try:
        stats = write(staging)
        if stats["train"].sequences == 0:
            raise UsageError(
                f"--input: no training sequence: {stats['train'].tokens} train tokens is less than "
                f"--seq-len + 1 = {opts.window}"
            )
        manifest = {
            "format": FORMAT,
            "options": opts.recorded(),
            "tokenizer": tokenizer,
            "inputs": inputs(),
            "splits": {
                split: {**vars(stats[split]), "shards": _shard_list(staging / split, split)} for split in SPLITS
            },
            **skips.describe(),
        }
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        outcome = _publish(staging, opts.out, opts.force)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return {
        "out": str(opts.out),
        "outcome": outcome,
        "manifest_sha256": hashlib.sha256((opts.out / MANIFEST).read_bytes()).hexdigest(),
        "splits": {s: vars(stats[s]) for s in SPLITS},
        "skipped": manifest["skipped"]["count"],
        "filtered": manifest["filtered"]["count"],
    }


def input_files(opts: PrepareOptions) -> list[InputFile]:
    return [InputFile(p, opts.spec()) for p in expand_inputs(opts.source, opts.inputs)]


def prepare(opts: PrepareOptions, *, progress: bool = True) -> dict:
    """Prepare the dataset in this process; returns build_dataset's summary."""
    files = input_files(opts)
    check_out_dir(opts, planned_inputs(files))
    tokenizer = gpt2_tokenizer()
    skips = Skips(opts.skip_bad)
    documents = counted(tokenized(_documents(files, skips), tokenizer, opts.workers), progress)
    return build_dataset(opts, lambda staging: write_splits(opts, documents, staging),
                         lambda: [input_entry(f) for f in files], skips, tokenizer.describe())
