"""megatron-core's checkpoint writes, made in this process: dist_checkpointing.save's writer threads
report through a plain queue instead of a multiprocessing Manager spawned for it, and a background
save's tensors are copied to host memory reused from save to save (train/engine_megatron.py goes
through here)."""

from __future__ import annotations

import contextlib
import functools
import queue
from collections.abc import Callable, Iterator
from typing import Any

from nlq_scale.compat import Private

DISTRIBUTION = "megatron-core"
WRITTEN_FOR = "==0.19.*"  # read against 0.19.2

_FS_ASYNC = "megatron.core.dist_checkpointing.strategies.filesystem_async"

# megatron's own async save ("mcore"): its default ("nvrx") needs nvidia-resiliency-ext, a writer of
# its own, and hands staged_write other arguments.
ASYNC_STRATEGY = "mcore"

RELIES_ON = (
    # in_process_writes: the results queue the writer takes when it plans a save, and the threads
    # that write its buckets in the calling process (none forked).
    Private(_FS_ASYNC, "get_write_results_queue"),
    Private(f"{_FS_ASYNC}:FileSystemWriterAsync.prepare_write_data",
            "self.results_queue = get_write_results_queue()", in_source=True),
    Private(f"{_FS_ASYNC}:FileSystemWriterAsync", "write_preloaded_data_multithread",
            params=("transform_list", "use_msc", "rank", "write_buckets", "global_results_queue")),
    # staged_write: the call a background save makes, and its arguments.
    Private(f"{_FS_ASYNC}:FileSystemWriterAsync.get_save_function_and_args",
            "partial(self.write_preloaded_data_multithread,", in_source=True),
    Private(f"{_FS_ASYNC}:FileSystemWriterAsync.get_save_function_and_args",
            "[torch.distributed.get_rank(), self.write_buckets, self.results_queue]", in_source=True),
)


@contextlib.contextmanager
def in_process_writes() -> Iterator[None]:
    """dist_checkpointing.save whose writer reports its results through a queue of this process.
    megatron-core (0.19) writes a save's buckets with threads of the calling process, but hands
    them a queue of a multiprocessing Manager it spawns on the first save of a process: on a CPU
    that spawn and the Manager's round trips cost as much as the write itself (docs/performance.md,
    "Checkpoints"). Files, fsyncs and results stay megatron's. A background save made in this
    context is written by `staged_write`'s call."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    original = filesystem_async.get_write_results_queue
    filesystem_async.get_write_results_queue = lambda *args, **kwargs: queue.SimpleQueue()
    try:
        yield
    finally:
        filesystem_async.get_write_results_queue = original


def storages(sharded: dict) -> frozenset[int]:
    """Where the tensors of a sharded state dict live (their storages' addresses): the memory the
    steps after a background save may change in place."""
    import torch
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    leaves = (getattr(leaf, "data", leaf) for leaf in nested_values(sharded))  # a ShardedTensor's, a factory's
    return frozenset(t.untyped_storage().data_ptr() for t in leaves if isinstance(t, torch.Tensor))


def staged_write(request: Any, live: frozenset[int], copies: HostCopies) -> tuple[Callable[[], None], Any] | None:
    """The write of a background save (dist_checkpointing.save(..., async_sharded_save=True) made
    within `in_process_writes`) as a call a thread or a forked process makes while training goes on,
    and the queue that call puts its results on (the save's finalization reads them there). The
    tensors it writes are copied to host memory now (`HostCopies.snapshot`). `live`: `storages` of
    the state dict saved. None when this rank has nothing to write."""
    import torch

    if request.async_fn is None:
        return None
    rank, buckets, results = request.async_fn_args
    staged = [
        (path, key, (data, [(item, copies.snapshot(item.index, tensor, live)) for item, tensor in tensors]))
        for path, key, (data, tensors) in buckets
    ]
    if any(tensor.is_cuda for _, _, (_, tensors) in buckets for _, tensor in tensors):
        torch.cuda.synchronize()
    return functools.partial(request.async_fn, rank, staged, results), results


class HostCopies:
    """The host memory background saves copy their tensors into, kept from one save to the next
    (one save at a time: the train loop commits a save before it starts another). A copy into new
    memory pays a page fault per 4 KB page; on a GPU the memory is pinned, so the device-to-host
    copies run asynchronously at the link's speed (megatron's preload copies into new pageable
    memory at every save). Costs one host copy of the state, for as long as the engine lives."""

    def __init__(self) -> None:
        self._memory: dict[Any, Any] = {}

    def snapshot(self, key: Any, tensor: Any, live: frozenset[int]) -> Any:
        """A tensor a background write may write while the next steps train: on a GPU, copied to
        the host (asynchronously: the caller synchronizes); on the host, copied where it shares
        memory with the state (`live`), which the steps change in place. A host tensor that shares
        none is a copy megatron already made (it clones a view of a larger buffer, so that only the
        view's elements are written): a second copy would double what the save's start costs."""
        import torch

        if tensor.device.type == "cpu" and tensor.untyped_storage().data_ptr() not in live:
            return tensor
        if not tensor.is_contiguous():  # its strides kept, as a synchronous save writes it
            return tensor.to("cpu", non_blocking=True, copy=True)
        memory = self._memory.get(key)
        if memory is None or memory.shape != tensor.shape or memory.dtype != tensor.dtype:
            memory = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
            self._memory[key] = memory
        return memory.copy_(tensor, non_blocking=True)
