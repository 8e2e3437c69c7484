"""`prepare-data --part I/N` and `--merge DIR`: one dataset prepared by N processes at once.

Part I of N takes the I-th of N equal stretches of the inputs' byte line (`prepare.Span`): whole
files, and inside a file the records read while the reader's position is in the stretch, so one
huge file is split too. A part tokenizes its documents and writes `DIR.parts/part-IIIII-of-NNNNN/`:

    tokens.u16   the documents' tokens (each ending in EOT), in input order
    docs.u64     per document: its val/train key and its token count
    part.json    the request, the span, counts, skipped and filtered records, and the sha256 of
                 the inputs whose last byte lies in the span (this part read them whole)

into a staging directory renamed into place at the end, so a killed part leaves nothing that looks
finished and rerunning it replaces only itself. `--merge DIR` streams the parts' documents, in
order, through the very splitter, packer and MDS writer of a single-process run
(`prepare.build_dataset`): the dataset is byte-identical to it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from nlq_scale.data.prepare import (
    SPLITS, Packer, PrepareOptions, Skips, Span, SplitStats, _documents, _staging_dir, build_dataset, check_out_dir,
    counted, file_offsets, input_entry, input_files, mds_writer, planned_inputs, tokenized, val_threshold, window_writer,
    write_splits,
)
from nlq_scale.data.tokenizer import gpt2_tokenizer
from nlq_scale.errors import UsageError

PART_FORMAT = "nlq-scale-part/1"
PART_JSON = "part.json"
TOKENS = "tokens.u16"
DOCS = "docs.u64"
PART_NAME = re.compile(r"part-(\d+)-of-(\d+)")
BLOCK_DOCS = 4096  # documents written, and read back by the merge, at once


def parse_part(text: str) -> tuple[int, int]:
    """`I/N` (1 <= I <= N) -> (I, N)."""
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not match or not 1 <= int(match[1]) <= int(match[2]):
        raise UsageError(f"--part {text}: expected I/N with 1 <= I <= N (e.g. --part 1/4)")
    return int(match[1]), int(match[2])


def parts_dir(out: Path) -> Path:
    """Where the parts of dataset DIR go: `DIR.parts/` beside it (same file system)."""
    return out.parent / f"{out.name}.parts"


def part_name(index: int, count: int) -> str:
    return f"part-{index:05d}-of-{count:05d}"


def part_span(offsets: list[int], index: int, count: int) -> Span:
    total = offsets[-1]
    return Span(total * (index - 1) // count, total * index // count)


# ---- writing one part -------------------------------------------------------------------------


def _write_stream(documents: Iterator[tuple[int, np.ndarray]], staging: Path) -> tuple[int, int]:
    """Tokens and (key, length) per document into the part's files; returns (documents, tokens)."""
    block: list[tuple[int, int]] = []
    docs = tokens = 0
    with (staging / TOKENS).open("wb") as tok, (staging / DOCS).open("wb") as doc:
        for key, ids in documents:
            tok.write(memoryview(ids.astype("<u2", copy=False)))
            block.append((key, len(ids)))
            tokens += len(ids)
            if len(block) == BLOCK_DOCS:
                doc.write(np.array(block, dtype="<u8").tobytes())
                docs += len(block)
                block = []
        doc.write(np.array(block, dtype="<u8").reshape(-1, 2).tobytes())
        docs += len(block)
        for f in (tok, doc):
            f.flush()
            os.fsync(f.fileno())  # the rename below must not outlive the data on a node crash
    return docs, tokens


def _replace(staging: Path, target: Path) -> str:
    if not target.exists():
        staging.rename(target)
        return "created"
    old = target.parent / f".{target.name}.old-{os.getpid()}"
    target.rename(old)
    staging.rename(target)
    shutil.rmtree(old)
    return "replaced"


def prepare_part(opts: PrepareOptions, index: int, count: int, *, progress: bool = True) -> dict:
    """Prepare part `index` of `count` into parts_dir(opts.out); returns a summary."""
    files = input_files(opts)
    planned = planned_inputs(files)
    check_out_dir(opts, planned)  # fail now, not at the merge, if DIR holds another dataset
    tokenizer = gpt2_tokenizer()
    offsets = file_offsets(files)
    span = part_span(offsets, index, count)
    target = parts_dir(opts.out) / part_name(index, count)
    skips = Skips(opts.skip_bad)
    staging = _staging_dir(target)
    try:
        documents = counted(tokenized(_documents(files, skips, span), tokenizer, opts.workers), progress)
        docs, tokens = _write_stream(documents, staging)
        owned = [k for k in range(len(files)) if span.start <= offsets[k + 1] - 1 < span.end]
        record = {
            "format": PART_FORMAT,
            "part": index,
            "parts": count,
            "options": opts.model_dump(mode="json", exclude={"out", "workers", "force"}),
            "recorded": opts.recorded(),
            "inputs": planned,
            "tokenizer": tokenizer.describe(),
            "span": [span.start, span.end],
            "documents": docs,
            "tokens": tokens,
            "skips": skips.state(),
            "digests": {str(k): input_entry(files[k]) for k in owned},
        }
        (staging / PART_JSON).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        outcome = _replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return {"out": str(target), "outcome": outcome, "part": f"{index}/{count}", "documents": docs,
            "tokens": tokens, "skipped": sum(skips.by_kind.values()), "filtered": sum(skips.filtered.values())}


# ---- merging ----------------------------------------------------------------------------------


def _find_parts(out: Path) -> list[Path]:
    root = parts_dir(out)
    found = {}
    if root.is_dir():
        for d in root.iterdir():
            match = PART_NAME.fullmatch(d.name)
            if match and d.is_dir():
                found[(int(match[1]), int(match[2]))] = d
    if not found:
        raise UsageError(f"--merge {out}: no parts in {root} (prepare them with --out {out} --part I/N)")
    counts = sorted({n for _, n in found})
    if len(counts) > 1:
        raise UsageError(f"--merge {out}: {root} holds parts of splits into {counts} parts; remove the stale ones")
    count = counts[0]
    missing = [i for i in range(1, count + 1) if (i, count) not in found]
    if missing:
        listed = ", ".join(f"{i}/{count}" for i in missing[:10]) + (" ..." if len(missing) > 10 else "")
        raise UsageError(f"--merge {out}: part {listed} missing from {root} (killed or not run?): run it with --part")
    return [found[(i, count)] for i in range(1, count + 1)]


def _read_part(part: Path) -> dict:
    try:
        record = json.loads((part / PART_JSON).read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"{part / PART_JSON}: unreadable ({e}); rerun this part") from None
    if record.get("format") != PART_FORMAT:
        raise UsageError(f"{part / PART_JSON}: not a {PART_FORMAT} part; rerun this part")
    sizes = {TOKENS: 2 * record["tokens"], DOCS: 16 * record["documents"]}
    for name, size in sizes.items():
        path = part / name
        if not path.is_file() or path.stat().st_size != size:
            raise UsageError(f"{path}: missing or not {size} bytes as {PART_JSON} says; rerun this part")
    lengths = np.fromfile(part / DOCS, dtype="<u8").reshape(-1, 2)[:, 1]
    if int(lengths.sum()) != record["tokens"]:
        raise UsageError(f"{part / DOCS}: document lengths add up to {int(lengths.sum())} tokens, not "
                         f"{record['tokens']}; rerun this part")
    return record


def _check_agree(parts: list[Path], records: list[dict]) -> None:
    """Every part must come from the same request: options, inputs (names and sizes), tokenizer."""
    first = records[0]
    for part, record in zip(parts[1:], records[1:]):
        for key in ("recorded", "inputs", "tokenizer"):
            if record[key] != first[key]:
                raise UsageError(f"{part}: {key} differ from {parts[0].name}'s (prepared from another request); "
                                 "rerun it with the same inputs and options")


def _part_documents(parts: list[Path], records: list[dict]) -> Iterator[tuple[int, np.ndarray]]:
    """The parts' documents in order, as (key, tokens) like the tokenizer yields them."""
    for part, record in zip(parts, records):
        if not record["documents"]:
            continue
        docs = np.memmap(part / DOCS, dtype="<u8", mode="r").reshape(-1, 2)
        tokens = np.memmap(part / TOKENS, dtype="<u2", mode="r")
        at = 0
        for lo in range(0, len(docs), BLOCK_DOCS):
            block = np.asarray(docs[lo : lo + BLOCK_DOCS])
            lengths = block[:, 1].astype(np.int64)
            ends = np.cumsum(lengths)
            chunk = np.array(tokens[at : at + int(ends[-1])], dtype=np.uint16)
            for key, start, end in zip(block[:, 0].tolist(), (ends - lengths).tolist(), ends.tolist()):
                yield key, chunk[start:end].copy()  # a copy: the val heap must not pin whole chunks
            at += int(ends[-1])


# ---- merging in parallel: shards cut ahead, written by several processes --------------------------
#
# With a val *fraction* every document's split is known from its key alone, so each split's token
# stream, its windows and (windows being of one size) the windows of every shard are known before
# anything is written: shard j holds windows [j*k, (j+1)*k). Ranges of shards are then written by
# separate processes, each with its own MDS writer over exactly its windows, and the shards renamed
# to their place; index.json is assembled from the writers' entries as the writer writes it. The
# byte-identity tests hold this to the single-process output.


@dataclass(frozen=True)
class Slice:
    """Part of one split's token stream: a part's files, and where the part's share of the split
    starts in the split's stream."""

    tokens: Path
    docs: Path
    start: int
    count: int


@dataclass(frozen=True)
class ShardTask:
    opts: PrepareOptions
    split: str
    threshold: int
    slices: list[Slice]
    first_shard: int
    window_start: int  # the shards hold windows [window_start, window_end) of the split
    window_end: int
    scratch: Path


def _split_docs(docs: Path, split: str, threshold: int) -> tuple[np.ndarray, np.ndarray]:
    """(start in the part's token file, length) of the part's documents in `split`."""
    table = np.fromfile(docs, dtype="<u8").reshape(-1, 2)
    lengths = table[:, 1].astype(np.int64)
    starts = np.cumsum(lengths) - lengths
    mine = (table[:, 0] < threshold) == (split == "val")
    return starts[mine], lengths[mine]


def _split_pieces(task: ShardTask, begin: int, end: int) -> Iterator[np.ndarray]:
    """The split's tokens [begin, end), piece by piece (documents cut at the ends)."""
    for piece in task.slices:
        if piece.start + piece.count <= begin or piece.start >= end:
            continue
        starts, lengths = _split_docs(piece.docs, task.split, task.threshold)
        at = piece.start + np.cumsum(lengths) - lengths  # each document's place in the split's stream
        tokens = np.memmap(piece.tokens, dtype="<u2", mode="r")
        first = max(int(np.searchsorted(at, begin, side="right")) - 1, 0)
        for i in range(first, len(at)):
            lo, hi = max(begin, int(at[i])), min(end, int(at[i] + lengths[i]))
            if lo >= end:
                break
            offset = int(starts[i]) - int(at[i])
            yield np.array(tokens[offset + lo : offset + hi], dtype=np.uint16)


def _write_shard_range(task: ShardTask) -> list[dict]:
    """Write the task's windows with a writer of its own; rename its shards to their place in the
    split; return their index entries."""
    window = task.opts.window
    writer = mds_writer(task.opts, task.scratch)
    packer = Packer(window, window_writer(writer))
    for piece in _split_pieces(task, task.window_start * window, task.window_end * window):
        packer.add(piece)
    writer.finish()
    entries = json.loads((task.scratch / "index.json").read_text())["shards"]
    split_dir = task.scratch.parent
    for n, entry in enumerate(entries):
        for key in ("raw_data", "zip_data"):
            if entry.get(key):
                name = entry[key]["basename"]
                entry[key]["basename"] = name.replace(f"shard.{n:05d}.", f"shard.{task.first_shard + n:05d}.", 1)
                (task.scratch / name).rename(split_dir / entry[key]["basename"])
    shutil.rmtree(task.scratch)
    return entries


def _shard_samples(opts: PrepareOptions, scratch: Path) -> int:
    """Windows per shard as the MDS writer cuts them: it closes a shard when the next sample would
    take it past the size limit, and every sample has the same size."""
    writer = mds_writer(opts, scratch)
    sample = len(writer.encode_sample({"tokens": np.zeros(opts.window, dtype=np.uint16)}))
    per_shard = (opts.shard_bytes - writer.new_shard_size) // (sample + writer.extra_bytes_per_sample)
    writer.finish()
    shutil.rmtree(scratch)
    return per_shard


def _split_tasks(opts: PrepareOptions, split: str, threshold: int, slices: list[Slice], total: int,
                 per_shard: int, workers: int, split_dir: Path) -> list[ShardTask]:
    windows = total // opts.window
    shards = -(-windows // per_shard)
    step = max(-(-shards // workers), 1)
    return [ShardTask(opts, split, threshold, slices, first, first * per_shard,
                      min((first + step) * per_shard, windows), split_dir / f".scratch-{first:05d}")
            for first in range(0, shards, step)]


def _parallel_write(opts: PrepareOptions, parts: list[Path], workers: int, staging: Path) -> dict[str, SplitStats]:
    threshold = val_threshold(opts.val_rule)
    per_shard = _shard_samples(opts, staging / ".probe")
    stats, tasks = {}, []
    for split in SPLITS:
        slices, total, documents = [], 0, 0
        for part in parts:
            _, lengths = _split_docs(part / DOCS, split, threshold)
            slices.append(Slice(part / TOKENS, part / DOCS, total, int(lengths.sum())))
            total += int(lengths.sum())
            documents += len(lengths)
        windows = total // opts.window
        stats[split] = SplitStats(documents, total, windows, total - windows * opts.window)
        (staging / split).mkdir()
        tasks.append(_split_tasks(opts, split, threshold, slices, total, per_shard, workers, staging / split))
    # fork: the workers start with mosaicml-streaming already imported, in a few milliseconds
    with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("fork")) as pool:
        written = {split: pool.map(_write_shard_range, split_tasks) for split, split_tasks in zip(SPLITS, tasks)}
        for split in SPLITS:
            entries = [entry for chunk in written[split] for entry in chunk]
            (staging / split / "index.json").write_text(json.dumps({"version": 2, "shards": entries}, sort_keys=True))
    return stats


def merge_parts(out: Path, *, force: bool = False, keep_parts: bool = False, progress: bool = True,
                workers: int = 1) -> dict:
    """Join the parts of DIR into the dataset DIR; the part directories are removed afterwards
    unless keep_parts. With a val fraction the shards are written by `workers` processes; with
    --val-docs (which needs every key before it can place a document) by this one, streaming the
    parts' documents through the single-process writer."""
    parts = _find_parts(out)
    records = [_read_part(p) for p in parts]
    _check_agree(parts, records)
    first = records[0]
    opts = PrepareOptions(**first["options"], out=out, force=force)
    check_out_dir(opts, [tuple(i) for i in first["inputs"]])
    digests = {int(k): entry for r in records for k, entry in r["digests"].items()}
    if sorted(digests) != list(range(len(first["inputs"]))):
        raise UsageError(f"--merge {out}: the parts do not cover every input; rerun them with the same --part N")
    skips = Skips(opts.skip_bad)
    for record in records:
        skips.add(record["skips"])
    if "fraction" in opts.val_rule:
        def write(staging: Path) -> dict[str, SplitStats]:
            return _parallel_write(opts, parts, workers, staging)
    else:
        def write(staging: Path) -> dict[str, SplitStats]:
            return write_splits(opts, counted(_part_documents(parts, records), progress), staging)
    summary = build_dataset(opts, write, lambda: [digests[k] for k in sorted(digests)], skips, first["tokenizer"])
    if not keep_parts:
        for part in parts:
            shutil.rmtree(part)
        if not any(parts_dir(out).iterdir()):
            parts_dir(out).rmdir()
    return {**summary, "parts": len(parts)}
