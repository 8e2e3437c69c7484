"""mosaicml-streaming glue for the train loader. Imports `streaming` (slow) at module level: import
this module lazily.

Each data-parallel rank presents itself to streaming as its own node (RANK = dp_rank,
WORLD_SIZE = dp_size, LOCAL_RANK = 0, LOCAL_WORLD_SIZE = 1). Streaming's partition interleaves
nodes exactly as it interleaves ranks, so the global batch at step k is still the same for any
dp_size, and a rank never needs another process while its dataset is built. That matters because
only one process per data-parallel rank builds a loader, while streaming's constructor calls
`torch.distributed.barrier()` on the default group whenever torch.distributed is initialised (a
deadlock under tensor or pipeline parallelism), and otherwise, for WORLD_SIZE > 1, initialises a
process group of its own. `standalone_construction` switches both off for the duration of the
constructor only.

Shared-memory hygiene: streaming names its /dev/shm segments `<prefix>_<name>` with a small integer
prefix shared by every job on the node, and keeps lock files in the temp dir. Each loader gets a
private temp dir `<tmp_dir>/streaming/<host>.<pid>.dp<rank>.*` holding `owner.json` (pid, process
start time, prefix, inode of the prefix's `locals` segment). `close()` releases exactly its own
segments; a later loader on the same host removes the leftovers of owners that died (SIGKILL),
and only while their `locals` segment is still the very one they created (same inode).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import random
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nlq_scale.compat import streaming as streaming_compat
from nlq_scale.compat.streaming import Stream, StreamingDataset
from nlq_scale.data.prepared import PreparedDataset, ShardFile, verify_shard
from nlq_scale.runtime.environ import environment

SHM_DIR = Path("/dev/shm")
OWNER = "owner.json"
PREFIX_RETRIES = 50


class CheckedStreamingDataset(StreamingDataset):
    """A StreamingDataset that checks a shard's xxh64 (from index.json) the first time this process
    reads a sample from it, so a corrupted shard fails with its name instead of yielding garbage."""

    def __init__(self, *, shard_files: list[ShardFile], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._shard_files = shard_files
        self._verified: set[int] = set()

    def get_item(self, sample_id: int, retry: int = 7) -> Any:
        shard_id, _ = self.spanner[sample_id]
        if shard_id not in self._verified:
            verify_shard(self._shard_files[shard_id])
            self._verified.add(shard_id)
        return super().get_item(sample_id, retry)


@contextlib.contextmanager
def standalone_construction(dp_rank: int, dp_size: int, private_tmp: Path) -> Iterator[None]:
    """While a StreamingDataset is built: this rank is node `dp_rank` of `dp_size` one-rank nodes,
    streaming's lock files go to `private_tmp`, and it makes no torch.distributed call."""
    env = {"RANK": str(dp_rank), "WORLD_SIZE": str(dp_size), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    with contextlib.ExitStack() as stack:
        stack.enter_context(environment(env))
        stack.enter_context(streaming_compat.standalone(private_tmp))
        yield


# ---- ownership of shared memory ---------------------------------------------------------------


def _host() -> str:
    return socket.gethostname().split(".")[0] or "host"


def _process_start(pid: int) -> str | None:
    """Start time of a live process (field 22 of /proc/<pid>/stat), to tell a reused pid apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _segment(prefix: int, name: str) -> Path:
    return SHM_DIR / streaming_compat.segment_name(prefix, name)


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except OSError:
        return None


def _reclaim(private: Path) -> None:
    """Remove a dead owner's segments (if its `locals` segment is still the one it made) and dir."""
    try:
        owner = json.loads((private / OWNER).read_text())
    except (OSError, ValueError):
        owner = None
    locals_segment = streaming_compat.LOCALS_SEGMENT
    if owner is not None and _inode(_segment(owner["prefix"], locals_segment)) == owner["locals_inode"]:
        for name in streaming_compat.SEGMENT_NAMES - {locals_segment}:
            _segment(owner["prefix"], name).unlink(missing_ok=True)
        _segment(owner["prefix"], locals_segment).unlink(missing_ok=True)
    shutil.rmtree(private, ignore_errors=True)


def reclaim_stale(root: Path) -> None:
    """Clean up after loaders on this host whose process is gone."""
    host = _host()
    for private in root.glob(f"{host}.*"):
        parts = private.name.split(".")
        if len(parts) < 3 or not parts[1].isdigit():
            continue
        pid = int(parts[1])
        try:
            recorded = json.loads((private / OWNER).read_text()).get("start")
        except (OSError, ValueError):
            recorded = None
        start = _process_start(pid)
        dead = start is None or (recorded is not None and start != recorded)
        if dead:
            _reclaim(private)


def private_dir(tmp_dir: Path, dp_rank: int) -> Path:
    root = Path(tmp_dir) / "streaming"
    while True:
        root.mkdir(parents=True, exist_ok=True)
        reclaim_stale(root)
        try:
            return Path(tempfile.mkdtemp(prefix=f"{_host()}.{os.getpid()}.dp{dp_rank}.", dir=root))
        except FileNotFoundError:  # the last loader of an earlier process removed the empty root just now
            continue


def remove_private_dir(private: Path) -> None:
    """Remove a loader's private dir, and the streaming root with it once no other loader has one."""
    shutil.rmtree(private, ignore_errors=True)
    with contextlib.suppress(OSError):  # not empty: another loader on this node still uses it
        private.parent.rmdir()


@dataclass
class Ownership:
    private: Path
    prefix: int

    @classmethod
    def record(cls, private: Path, dataset: StreamingDataset) -> Ownership:
        prefix = streaming_compat.shm_prefix(dataset)
        owner = {
            "host": _host(),
            "pid": os.getpid(),
            "start": _process_start(os.getpid()),
            "prefix": prefix,
            "locals_inode": _inode(_segment(prefix, streaming_compat.LOCALS_SEGMENT)),
        }
        tmp = private / f"{OWNER}.tmp"
        tmp.write_text(json.dumps(owner))
        tmp.replace(private / OWNER)
        return cls(private, prefix)

    def release(self, dataset: StreamingDataset) -> None:
        """Stop streaming's threads, unlink the segments this loader created (`locals` last: while
        any of them exists no other job can take the prefix), and remove the private dir."""
        streaming_compat.stop_threads(dataset)
        locals_last = lambda w: w.shm.name.endswith(streaming_compat.LOCALS_SEGMENT)  # noqa: E731
        wrappers = sorted(streaming_compat.shared_memory_wrappers(dataset), key=locals_last)
        for wrapper in wrappers:
            try:
                wrapper.cleanup()
            except BufferError:  # a numpy view still maps it: leave it to streaming's atexit
                continue
            # streaming registered cleanup() at exit; a second unlink by name could hit a segment
            # that another job created under the same prefix after this one was released
            atexit.unregister(wrapper.cleanup)
        remove_private_dir(self.private)


def _mark_occupied_prefixes(private: Path) -> None:
    """Streaming picks, for each segment name separately, the first prefix where that name is free,
    and takes the largest: with gaps (segments leaked by killed jobs) that prefix can still be in
    use. Streaming skips any prefix whose lock file exists in the temp dir, so a lock-file name in
    the private temp dir for every prefix with any segment makes it pick a prefix that is wholly free.
    """
    for segment in SHM_DIR.iterdir():
        prefix = streaming_compat.prefix_of_segment(segment.name)
        if prefix is not None:
            (private / streaming_compat.prefix_lock_name(prefix)).touch()


def set_position(dataset: StreamingDataset, *, epoch: int, sample_in_epoch: int, num_canonical_nodes: int,
                 seed: int) -> None:
    """Where the next iteration starts. Each load_state_dict() call makes a new resume segment
    wrapper; the previous one (which created the segment) is released first so close() finds it."""
    previous = streaming_compat.resume_segment(dataset)
    if previous is not None:
        previous.cleanup()
        atexit.unregister(previous.cleanup)
    dataset.next_epoch = epoch
    dataset.load_state_dict({
        "epoch": epoch,
        "sample_in_epoch": sample_in_epoch,
        "num_canonical_nodes": num_canonical_nodes,
        "shuffle_seed": seed,
    })


def open_train_dataset(
    datasets: list[tuple[PreparedDataset, float | None]],
    *,
    seed: int,
    shuffle_algo: str,
    num_canonical_nodes: int,
    rank_batch_size: int,
    dp_rank: int,
    dp_size: int,
    tmp_dir: Path,
) -> tuple[CheckedStreamingDataset, Ownership]:
    private = private_dir(tmp_dir, dp_rank)
    shard_files = [shard.raw for ds, _ in datasets for shard in ds.shards("train")]
    jitter = random.Random()  # never the global RNG: the train loop may seed it
    try:
        with standalone_construction(dp_rank, dp_size, private):
            for _ in range(PREFIX_RETRIES):
                _mark_occupied_prefixes(private)
                # fresh Streams each attempt: streaming writes the derived weights into them
                streams = [Stream(local=str(ds.path), split="train", proportion=p) for ds, p in datasets]
                try:
                    dataset = CheckedStreamingDataset(
                        streams=streams, shard_files=shard_files, shuffle=True, shuffle_algo=shuffle_algo,
                        shuffle_seed=seed, num_canonical_nodes=num_canonical_nodes, partition_algo="orig",
                        batch_size=rank_batch_size,
                    )
                    break
                except FileExistsError:
                    # another job registered the same prefix at the same moment; the next attempt
                    # sees it taken
                    time.sleep(jitter.uniform(0.01, 0.1))
            else:
                raise RuntimeError(f"no free streaming shared-memory prefix after {PREFIX_RETRIES} attempts")
    except BaseException:
        remove_private_dir(private)
        raise
    return dataset, Ownership.record(private, dataset)
