"""The deterministic token stream the train loop consumes, the fixed validation set, and the batch
digest that proves two runs saw the same stream.

Guarantee: the multiset of sequences in the global batch at step k is a function of (dataset
manifest(s), data.seed, global batch size, seq_length) only: not of dp_size, DataLoader workers or
the model arm. How: mosaicml-streaming's `py1e` shuffle (no padding) over a fixed
`num_canonical_nodes`, with the `orig` partition, puts global batch k at positions
[k*G, (k+1)*G) of the epoch's sample order for any number of ranks and workers; an epoch is cut
after floor(epoch_size / G) full steps, so no step ever holds padding or a partial batch; and the
loader (not streaming) owns the position (epoch, step), which it hands to streaming each time it
starts iterating, so resuming, also at another dp_size with the same global batch, is exact.

Importing streaming (nlq_scale.compat.streaming) takes about a second: it happens inside
`make_train_loader` / `make_val_set` only.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
from typing import Any

import numpy as np
import torch

from nlq_scale.compat.torch import stop_loader_workers
from nlq_scale.config.schema import DataConfig
from nlq_scale.data.prepared import CorruptShard, PreparedDataset, ensure_decompressed, open_prepared, verify_shard
from nlq_scale.errors import RunFailure, UsageError

STATE_FORMAT = 1
DIGEST_BYTES = 16


# ---- which datasets ---------------------------------------------------------------------------


def _datasets(data: DataConfig) -> list[tuple[PreparedDataset, float | None]]:
    if data.path is not None:
        return [(open_prepared(data.path, field="data.path"), None)]
    if data.streams:
        return [(open_prepared(s.path, field=f"data.streams[{i}].path"), s.proportion) for i, s in enumerate(data.streams)]
    raise UsageError("data.path: no dataset configured (set data.path or data.streams)")


def _check_seq_len(ds: PreparedDataset, seq_length: int) -> None:
    if ds.seq_len != seq_length:
        raise UsageError(
            f"data: {ds.path} was prepared with --seq-len {ds.seq_len}, but model.seq_length is {seq_length}; "
            f"re-run nlq-scale prepare-data --seq-len {seq_length}"
        )


def _checked_datasets(data: DataConfig, seq_length: int) -> list[tuple[PreparedDataset, float | None]]:
    datasets = _datasets(data)
    for ds, _ in datasets:
        _check_seq_len(ds, seq_length)
    first = datasets[0][0]
    for ds, _ in datasets[1:]:
        if ds.tokenizer != first.tokenizer:
            raise UsageError(f"data.streams: {ds.path} and {first.path} were tokenized differently")
    return datasets


def _manifest_digest(datasets: list[tuple[PreparedDataset, float | None]]) -> str:
    first, proportion = datasets[0]
    if proportion is None:  # data.path
        return first.manifest_sha256
    entries = sorted([ds.manifest_sha256, p] for ds, p in datasets)
    return hashlib.sha256(json.dumps(entries).encode()).hexdigest()


def dataset_manifest_sha256(data: DataConfig) -> str | None:
    """sha256 of the dataset's manifest.json; for a mixture, of the sorted (sha256, proportion) list."""
    if data.path is None and not data.streams:
        return None
    return _manifest_digest(_datasets(data))


# ---- training stream --------------------------------------------------------------------------


def collate_tokens(samples: list[dict[str, np.ndarray]]) -> torch.Tensor:
    return torch.from_numpy(np.stack([s["tokens"] for s in samples]).astype(np.int64))


def _one_line(error: CorruptShard) -> CorruptShard:
    """A DataLoader worker re-raises an exception with the worker's traceback in its message."""
    lines = str(error).strip().splitlines()
    last = lines[-1] if lines else ""
    return CorruptShard(last.split(": ", 1)[1] if last.startswith(("nlq_scale.", "CorruptShard")) else last)


class TrainLoader:
    """Yields this data-parallel rank's batch per optimizer step as a LongTensor
    [rank_batch_size, seq_length + 1], epoch after epoch, forever."""

    def __init__(self, dataset: Any, ownership: Any, *, rank_batch_size: int, dp_size: int, num_workers: int,
                 identity: dict[str, Any]) -> None:
        from torch.utils.data import DataLoader

        self._dataset = dataset
        self._ownership = ownership
        self.global_batch = rank_batch_size * dp_size
        self.steps_per_epoch = dataset.epoch_size // self.global_batch
        self._identity = identity
        # Its own generator: each epoch's iterator draws a base seed for its workers, which from torch's
        # global generator would put a resumed run's RNG states a draw ahead of a straight run's.
        self._loader = DataLoader(dataset, batch_size=rank_batch_size, num_workers=num_workers,
                                  collate_fn=collate_tokens, persistent_workers=False,
                                  generator=torch.Generator().manual_seed(identity["seed"]))  # fmt: skip
        self._batches: Any = None
        self.epoch = 0
        self.step_in_epoch = 0
        self._closed = False

    def __iter__(self) -> TrainLoader:
        return self

    def __next__(self) -> torch.Tensor:
        if self._closed:
            raise RuntimeError("TrainLoader is closed")
        if self._batches is None:
            self._start_iterating()
        try:
            batch = next(self._batches)
        except CorruptShard as e:
            raise _one_line(e) from None
        except StopIteration:
            raise RunFailure(f"streaming ended epoch {self.epoch} early at step {self.step_in_epoch}") from None
        self.step_in_epoch += 1
        if self.step_in_epoch == self.steps_per_epoch:
            self._stop_iterating()
            self.epoch += 1
            self.step_in_epoch = 0
        return batch

    def _start_iterating(self) -> None:
        """Tell streaming exactly where to start; it then never guesses the epoch itself."""
        from nlq_scale.data.streamset import set_position

        set_position(self._dataset, epoch=self.epoch, sample_in_epoch=self.step_in_epoch * self.global_batch,
                     num_canonical_nodes=self._identity["num_canonical_nodes"], seed=self._identity["seed"])
        self._batches = iter(self._loader)

    def _stop_iterating(self) -> None:
        batches, self._batches = self._batches, None
        stop_loader_workers(batches)

    def state_dict(self) -> dict[str, Any]:
        return {"format": STATE_FORMAT, "epoch": self.epoch, "step_in_epoch": self.step_in_epoch, **self._identity}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise UsageError(f"data loader state: unknown format {state.get('format') if isinstance(state, dict) else state!r}")
        for key, value in self._identity.items():
            if state.get(key) != value:
                raise UsageError(
                    f"data loader state: {key} was {state.get(key)!r} when saved, now {value!r}; "
                    "the token stream would differ, so this checkpoint cannot resume this run"
                )
        epoch, step = int(state["epoch"]), int(state["step_in_epoch"])
        if epoch < 0 or not 0 <= step < self.steps_per_epoch:
            raise UsageError(f"data loader state: position epoch {epoch} step {step} is out of range")
        self._stop_iterating()
        self.epoch, self.step_in_epoch = epoch, step

    def close(self) -> None:
        """Stop workers and release this loader's shared memory and lock files (only its own)."""
        if self._closed:
            return
        self._closed = True
        self._stop_iterating()
        self._ownership.release(self._dataset)


def make_train_loader(
    data: DataConfig,
    *,
    seq_length: int,
    rank_batch_size: int,
    dp_rank: int,
    dp_size: int,
    tmp_dir: pathlib.Path,
) -> TrainLoader:
    """Only one process per data-parallel rank calls this. Each data-parallel rank is its own
    streaming node (see streamset.py), so ranks never coordinate through shared memory and need no
    local rank."""
    if not 0 <= dp_rank < dp_size:
        raise UsageError(f"dp_rank {dp_rank} is outside data-parallel size {dp_size}")
    if rank_batch_size < 1:
        raise UsageError(f"rank batch size must be positive, got {rank_batch_size}")
    if data.seed < 0:
        raise UsageError(f"data.seed must be >= 0 for streaming's shuffle, got {data.seed}")
    ncn = data.num_canonical_nodes
    if ncn % dp_size and dp_size % ncn:
        raise UsageError(
            f"data.num_canonical_nodes ({ncn}) and the data-parallel size ({dp_size}) must divide one another"
        )
    datasets = _checked_datasets(data, seq_length)
    for ds, _ in datasets:
        ensure_decompressed(ds, "train")

    from nlq_scale.data.streamset import open_train_dataset

    dataset, ownership = open_train_dataset(
        datasets, seed=data.seed, shuffle_algo=data.shuffle_algo, num_canonical_nodes=ncn,
        rank_batch_size=rank_batch_size, dp_rank=dp_rank, dp_size=dp_size, tmp_dir=pathlib.Path(tmp_dir),
    )
    global_batch = rank_batch_size * dp_size
    if dataset.epoch_size < global_batch:
        ownership.release(dataset)
        raise UsageError(
            f"data: an epoch holds {dataset.epoch_size} sequences, fewer than one global batch ({global_batch})"
        )
    identity = {
        "dataset": _manifest_digest(datasets),
        "seed": data.seed,
        "shuffle_algo": data.shuffle_algo,
        "num_canonical_nodes": ncn,
        "global_batch": global_batch,
        "seq_length": seq_length,
    }
    return TrainLoader(dataset, ownership, rank_batch_size=rank_batch_size, dp_size=dp_size,
                       num_workers=data.num_workers, identity=identity)


# ---- validation set ---------------------------------------------------------------------------


def _apportion(total: int, weights: list[float]) -> list[int]:
    """Integer shares of `total` proportional to `weights` (largest remainder, ties to the first)."""
    exact = [total * w / sum(weights) for w in weights]
    shares = [int(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(exact[i] - shares[i]), i))
    for i in by_remainder[: total - sum(shares)]:
        shares[i] += 1
    return shares


def _val_rows(ds: PreparedDataset, count: int, field: str = "data.val_sequences") -> list[np.ndarray]:
    """`count` sequences spread evenly over the dataset's val split (its first, then every M/count-th)."""
    available = ds.sequences("val")
    if available < count:
        raise UsageError(
            f"{field}: {ds.path}/val holds {available} sequences, fewer than the {count} asked for; "
            f"lower {field} or re-run prepare-data with a larger --val-fraction/--val-docs"
        )
    if count == 0:
        return []
    ensure_decompressed(ds, "val")
    from nlq_scale.compat.streaming import LocalDataset

    local = LocalDataset(local=str(ds.path), split="val")
    shard_files = [s.raw for s in ds.shards("val")]
    rows, verified = [], set()
    for i in range(count):
        index = i * available // count
        shard_id, _ = local.spanner[index]
        if shard_id not in verified:
            verify_shard(shard_files[shard_id])
            verified.add(shard_id)
        rows.append(local[index]["tokens"])
    return rows


def make_val_set(data: DataConfig, *, seq_length: int) -> torch.Tensor:
    """The fixed validation set: data.val_sequences sequences of the val split(s), [N, seq_length+1].
    A mixture takes each stream's share by proportion. Identical on every call, for every arm."""
    return _fixed_val_set(data, _checked_datasets(data, seq_length))


def _fixed_val_set(data: DataConfig, datasets: list[tuple[PreparedDataset, float | None]]) -> torch.Tensor:
    weights = [p if p is not None else 1.0 for _, p in datasets]
    rows = []
    for (ds, _), count in zip(datasets, _apportion(data.val_sequences, weights)):
        rows.extend(_val_rows(ds, count))
    return _stacked(rows)


def _stacked(rows: list[np.ndarray]) -> torch.Tensor:
    return torch.from_numpy(np.stack(rows).astype(np.int64))


def make_val_sets(data: DataConfig, *, seq_length: int) -> dict[str, torch.Tensor]:
    """Every validation set by its metric (DataConfig.val_sets): the fixed set above as val/loss, and
    each named set's sequences, spread over its dataset's val split the same way, as val/<name>/loss.
    Independent of world size and arm, like the fixed set."""
    datasets = _checked_datasets(data, seq_length)
    sets = {"val/loss": _fixed_val_set(data, datasets)}
    first = datasets[0][0]
    for i, v in enumerate(data.validation):
        ds = open_prepared(v.path, field=f"data.validation[{i}].path")
        _check_seq_len(ds, seq_length)
        if ds.tokenizer != first.tokenizer:
            raise UsageError(f"data.validation[{i}].path: {ds.path} was tokenized differently from {first.path}")
        sets[f"val/{v.name}/loss"] = _stacked(_val_rows(ds, v.sequences, f"data.validation[{i}].sequences"))
    return sets


# ---- digest -----------------------------------------------------------------------------------


def sequence_digests(batch: torch.Tensor) -> np.ndarray:
    """One 16-byte blake2b digest per sequence, over its token ids as little-endian int64."""
    rows = batch.detach().to("cpu", torch.int64).numpy().astype("<i8", copy=False)
    return np.stack([
        np.frombuffer(hashlib.blake2b(row.tobytes(), digest_size=DIGEST_BYTES).digest(), dtype=np.uint8)
        for row in rows
    ])


def batch_digest(rank_batch: torch.Tensor, group: Any = None, device: Any = None) -> str:
    """Hash of the global batch: every rank's per-sequence digests, gathered over `group` (None:
    the default group, or this process alone without torch.distributed), sorted, hashed. So it does
    not depend on the data-parallel size or on the order of sequences. The gather runs on `device`
    (the runtime's Device; NCCL takes device tensors only)."""
    import torch.distributed as dist

    digests = torch.from_numpy(sequence_digests(rank_batch))
    if dist.is_available() and dist.is_initialized():
        local = device.put(digests) if device is not None else digests
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, local, group=group)
        digests = torch.cat(gathered).cpu()
    ordered = sorted(bytes(row) for row in digests.numpy())
    return hashlib.blake2b(b"".join(ordered), digest_size=DIGEST_BYTES).hexdigest()
