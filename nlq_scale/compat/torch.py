"""torch internals: the weak tensor-keyed dict the device check uses, stopping a DataLoader's
worker processes, and the private names and plain-pickle read of torch.distributed.checkpoint
metadata that train/untrusted.py guards (runtime/device_check.py, data/loader.py and
train/untrusted.py go through here)."""

from __future__ import annotations

from typing import Any

from torch.utils.weak import WeakTensorKeyDictionary

from nlq_scale.compat import Private

DISTRIBUTION = "torch"
WRITTEN_FOR = ">=2.6,<2.15"  # read against 2.14.1; the floor is megatron-core's

# Globals besides dataclasses, enums and torch constants that torch.distributed.checkpoint's
# `.metadata` pickles: (module, name) pairs.
DCP_METADATA_GLOBALS = frozenset({("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")})

RELIES_ON = (
    Private("torch.utils.weak", "WeakTensorKeyDictionary"),
    Private("torch.serialization", "_get_layout", params=("name",)),
    # untrusted.check_metadata exists because of this: `.metadata` is read with plain pickle.
    Private("torch.distributed.checkpoint.filesystem:FileSystemReader.read_metadata", "pickle.load(", in_source=True),
    Private("torch.utils.data.dataloader:_MultiProcessingDataLoaderIter", "_shutdown_workers", params=()),
    # compat.megatron.direct_tensor_reads: a torch.distributed.checkpoint item is a torch.save'd tensor
    # at (offset, length) of its file; loaded onto the meta device, its storage says where its bytes start.
    Private("torch.distributed.checkpoint.filesystem:FileSystemReader.read_data",
            "torch.load(", in_source=True),
    Private("torch.distributed.checkpoint.filesystem:FileSystemReader.read_data",
            "item_md.transform_descriptors", in_source=True),
    Private("torch.serialization:_load", "storage._checkpoint_offset", in_source=True),
)


def stop_loader_workers(batches: Any) -> None:
    """Stop the worker processes of a DataLoader iterator now (torch does it only when the iterator
    is garbage-collected); an iterator without workers has nothing to stop."""
    shutdown = getattr(batches, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()

__all__ = ["DCP_METADATA_GLOBALS", "WeakTensorKeyDictionary", "stop_loader_workers"]
