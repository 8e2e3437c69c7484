"""megatron-core's checkpoint reads: stored tensors read straight into the tensors they load into,
and loads in the saved layout without torch.distributed.checkpoint's resharding plans
(train/engine_megatron.py goes through here)."""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Iterator
from typing import Any

from nlq_scale.compat import Private

DISTRIBUTION = "megatron-core"
WRITTEN_FOR = "==0.19.*"  # read against 0.19.2

_TORCH_STRATEGY = "megatron.core.dist_checkpointing.strategies.torch"
_CHECKPOINTABLE = "megatron.core.dist_checkpointing.strategies.checkpointable"

RELIES_ON = (
    # direct_tensor_reads: the reader megatron's torch_dist load strategy asks this module function
    # for, with the strategy's cache_metadata (same_layout_strategy's is set).
    Private(_TORCH_STRATEGY, "_get_filesystem_reader", params=("checkpoint_dir", "cache_metadata", "async_strategy")),
    Private(f"{_TORCH_STRATEGY}:TorchDistLoadShardedStrategy.load",
            "checkpoint_dir, cache_metadata=self.cache_metadata, async_strategy=async_strategy", in_source=True),
    Private(f"{_TORCH_STRATEGY}:TorchDistLoadShardedStrategy", "load",
            params=("sharded_state_dict", "checkpoint_dir", "async_strategy")),
    Private(_TORCH_STRATEGY, "MultiStorageClientFeature"),
    # same_layout_strategy: where the torch_dist format stores a ShardedTensor (its key, its global
    # offset, its local shape behind prepend_axis_num ones) and a ShardedObject (a torch.save'd list
    # under its unique key), and what it returns in their places.
    *(Private(where, text, in_source=True) for where, text in (
        (f"{_TORCH_STRATEGY}:_replace_state_dict_keys_with_sharded_keys",
         "key = sh_base.unique_key if isinstance(sh_base, ShardedObject) else sh_base.key"),
        (f"{_TORCH_STRATEGY}:sharded_tensor_to_torch_sharded_tensor", "(1,) * prepend_axis_num + sh_ten.local_shape"),
        (f"{_TORCH_STRATEGY}:sharded_tensor_to_torch_sharded_tensor",
         "Shard.from_tensor_and_offsets(sh_ten.data, list(sh_ten.global_offset), rank)"),
        (f"{_CHECKPOINTABLE}:CheckpointableShardedTensor.__create_write_items__",
         "offsets = torch.Size(sh_ten._sh_ten.global_offset)"),
        (f"{_CHECKPOINTABLE}:CheckpointableShardedTensor.__create_write_items__",
         "chunk_size = torch.Size(sh_ten._sh_ten.local_shape)"),
        (f"{_TORCH_STRATEGY}:mcore_to_pyt_state_dict", "torch.save([sh_obj.data for sh_obj in sh_objs], serialized_data)"),
        (f"{_TORCH_STRATEGY}:mcore_to_pyt_state_dict",
         "init_fn=torch.zeros if sh_ten.allow_shape_mismatch else torch.empty"),
        (f"{_TORCH_STRATEGY}:_unwrap_pyt_sharded_tensor", "return [sh_ten._sh_ten.data]"),
    )),
)


class _Window(io.RawIOBase):
    """Bytes [start, start + length) of a seekable binary stream, as a stream of their own: one
    stored item of a checkpoint file, for zipfile (torch's own file view takes a seek from the end
    the wrong way round, and zipfile makes one)."""

    def __init__(self, stream: Any, start: int, length: int) -> None:
        super().__init__()
        self._stream, self._start, self._length, self._pos = stream, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        pos = offset + {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        if pos < 0:
            raise ValueError(f"negative seek position {pos}")
        self._pos = pos
        return pos

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), self._length - self._pos))
        if n == 0:
            return 0
        self._stream.seek(self._start + self._pos)
        got = self._stream.readinto(memoryview(buffer).cast("B")[:n])
        self._pos += got
        return got


def _staged(target: Any) -> bool:
    """Whether a direct read goes through host memory: a device target's (a CPU one takes the bytes
    itself)."""
    return target.device.type != "cpu"


def _direct_reader_class() -> type:
    """torch.distributed.checkpoint's file reader over the checkpoint metadata of one load (read
    once for it: megatron's cached-metadata reader keeps every path's metadata for the life of the
    process, stale once a checkpoint directory is written again), reading a whole stored tensor
    straight into the tensor it is loaded into. torch.distributed.checkpoint's FileSystemReader torch.loads each stored
    tensor into new memory and then copies it into place; here only the item's header is read
    (`compat.torch.stored_tensor`: dtype, shape, strides, byte order and where the storage's bytes
    start), and when the item is one contiguous little-endian tensor of the target's dtype and shape
    that the target takes whole, its bytes are read into the target (a device target: into host
    memory reused from item to item, then copied). Anything else — transformed (compressed) items,
    partial reads (resharding), strided or other-dtype targets, tensor subclasses, big-endian files
    or hosts — goes through torch's own read_data."""
    import dataclasses

    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.planner import LoadItemType

    from nlq_scale.compat.torch import stored_tensor

    def read_exactly(stream: Any, offset: int, target: torch.Tensor, relative_path: str) -> None:
        view = memoryview(target.view(-1).view(torch.uint8).numpy())
        stream.seek(offset)
        done = 0
        while done < len(view):
            n = stream.readinto(view[done:])
            if not n:
                raise EOFError(f"{relative_path}: truncated tensor at byte {offset + done}")
            done += n

    def staged_read(stream: Any, offset: int, target: torch.Tensor, relative_path: str, staging: list) -> None:
        """Into host memory kept for the next item (grown where too small), then a blocking copy
        into `target`: the buffer is free again when it returns."""
        nbytes = target.numel() * target.element_size()
        if staging[0].numel() < nbytes:
            staging[0] = torch.empty(nbytes, dtype=torch.uint8)
        host = staging[0][:nbytes]
        read_exactly(stream, offset, host, relative_path)
        target.copy_(host.view(target.dtype).view(target.shape))

    class DirectTensorReader(FileSystemReader):
        def __init__(self, path: Any, metadata: Any) -> None:
            super().__init__(path)
            self._metadata = metadata

        def read_metadata(self) -> Any:
            return self._metadata

        def _direct(self, stream: Any, req: Any, planner: Any) -> tuple[torch.Tensor, int] | None:
            """The tensor `req` reads into and where in the file its bytes start, when the read can
            go straight there; None when torch's path must read it."""
            item_md = self.storage_data[req.storage_index]
            if req.type != LoadItemType.TENSOR or item_md.transform_descriptors or any(req.storage_offsets):
                return None
            target = planner.resolve_tensor(req).detach()
            if type(target) is not torch.Tensor or not target.is_contiguous():
                return None
            stored = stored_tensor(_Window(stream, item_md.offset, item_md.length))
            if stored is None or not stored.little_endian or not stored.is_whole_contiguous():
                return None
            if stored.dtype != target.dtype or stored.shape != tuple(target.shape):
                return None
            return target, item_md.offset + stored.data_offset

        def read_data(self, plan, planner):
            if sys.byteorder != "little":
                return super().read_data(plan, planner)
            per_file: dict[str, list] = {}
            for req in plan.items:
                per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
            rest, staging = [], [torch.empty(0, dtype=torch.uint8)]
            for relative_path, reqs in per_file.items():
                with self.fs.create_stream(self.fs.concat_path(self.path, relative_path), "rb") as stream:
                    for req in reqs:
                        direct = self._direct(stream, req, planner)
                        if direct is None:
                            rest.append(req)
                            continue
                        target, offset = direct
                        if _staged(target):
                            staged_read(stream, offset, target, relative_path, staging)
                        else:
                            read_exactly(stream, offset, target, relative_path)
                        planner.commit_tensor(req, target)
            return super().read_data(dataclasses.replace(plan, items=rest), planner)

    return DirectTensorReader


@contextlib.contextmanager
def direct_tensor_reads(metadata: Any) -> Iterator[None]:
    """dist_checkpointing.load through `_direct_reader_class`'s reader over `metadata` (the
    checkpoint's, `checkpoint_metadata`) wherever megatron's torch_dist load strategy asks its
    module function for a cached-metadata reader (`same_layout_strategy`'s does); other reads and
    multi-storage-client paths keep megatron's."""
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy

    original = torch_strategy._get_filesystem_reader
    reader = _direct_reader_class()

    def get_reader(checkpoint_dir, cache_metadata=False, async_strategy="mcore"):
        if cache_metadata and not torch_strategy.MultiStorageClientFeature.is_enabled():
            return reader(checkpoint_dir, metadata)
        return original(checkpoint_dir, cache_metadata, async_strategy)

    torch_strategy._get_filesystem_reader = get_reader
    try:
        yield
    finally:
        torch_strategy._get_filesystem_reader = original


class _SameLayoutPlan:
    """What a load reads when every tensor it asks for is a chunk the checkpoint stores whole: one
    read item per tensor (and per object), addressed by the checkpoint's own index. Doubles as the
    planner torch.distributed.checkpoint's reader hands what it read to."""

    def __init__(self) -> None:
        self.items: list = []
        self.targets: dict = {}
        self.objects: dict[str, list] = {}

    def resolve_tensor(self, req: Any) -> Any:
        return self.targets[req.dest_index]

    def commit_tensor(self, req: Any, tensor: Any) -> None:
        pass  # read into the target itself

    def load_bytes(self, req: Any, value: io.BytesIO) -> None:
        import torch

        self.objects[req.dest_index.fqn] = torch.load(value, map_location="cpu", weights_only=True)


def _same_layout_tensor(plan: _SameLayoutPlan, sh: Any, metadata: Any) -> bool:
    """Add the read of ShardedTensor `sh` to `plan` when the checkpoint stores exactly its chunk."""
    import torch
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    stored = metadata.state_dict_metadata.get(sh.key)
    if sh.flattened_range is not None or sh.allow_shape_mismatch or not isinstance(stored, TensorStorageMetadata):
        return False
    offset = torch.Size(sh.global_offset)
    sizes = torch.Size((1,) * sh.prepend_axis_num + tuple(sh.local_shape))
    index = MetadataIndex(sh.key, offset)
    if stored.size != torch.Size(sh.global_shape) or not any(c.offsets == offset and c.sizes == sizes for c in stored.chunks):
        return False
    if index not in metadata.storage_data or index in plan.targets:
        return False
    if sh.data is None:
        sh.init_data(torch.device("cpu"), init_fn=torch.empty)  # as megatron's own load does
    if not sh.data.is_contiguous():
        return False
    plan.targets[index] = sh.data.detach().view(sizes)
    zeros = torch.Size([0] * len(sizes))
    plan.items.append(ReadItem(LoadItemType.TENSOR, index, zeros, index, zeros, sizes))
    return True


def _same_layout_object(plan: _SameLayoutPlan, sh: Any, metadata: Any) -> bool:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    index = MetadataIndex(sh.unique_key)
    if not isinstance(metadata.state_dict_metadata.get(sh.unique_key), BytesStorageMetadata):
        return False
    if index not in metadata.storage_data or sh.unique_key in plan.objects:
        return False
    plan.objects[sh.unique_key] = []
    plan.items.append(ReadItem(LoadItemType.BYTE_IO, index, None, index, None, None))
    return True


def _same_layout_plan(sharded_state_dict: dict, metadata: Any) -> _SameLayoutPlan | None:
    """The reads of a load whose layout is the checkpoint's, or None where any tensor must be
    resharded (another TP/PP/EP split, a padded vocabulary, DP-split flat ranges) or anything else
    is not one stored item of its own."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    plan = _SameLayoutPlan()
    for sh in nested_values(sharded_state_dict):
        if isinstance(sh, ShardedTensor):
            ok = _same_layout_tensor(plan, sh, metadata)
        else:
            ok = isinstance(sh, ShardedObject) and _same_layout_object(plan, sh, metadata)
        if not ok:
            return None
    return plan


def _everyone(ok: bool, device: Any) -> bool:
    """Whether `ok` holds on every rank: the loads must agree, or the ranks taking
    torch.distributed.checkpoint's path wait in its collectives for ranks that never join them."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return ok
    flag = torch.tensor([int(ok)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def checkpoint_metadata(checkpoint_dir: Any) -> Any:
    """torch.distributed.checkpoint's metadata of a torch_dist checkpoint (what it stores, where)."""
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(checkpoint_dir)).read_metadata()


def same_layout_strategy(device: Any, metadata: Any) -> Any:
    """megatron's torch_dist load strategy, skipping torch.distributed.checkpoint's planning where
    the checkpoint was saved in the layout it is loaded in: each tensor then reads its own stored
    chunk, through the same reader (`direct_tensor_reads`, which the load must be made within), and no shards are built, overlapped or
    exchanged between ranks. Where any rank's layout differs, every rank loads through megatron's
    path, which reshards. `device`: where the ranks' agreement is reduced (the process group's);
    `metadata`: the checkpoint's (`checkpoint_metadata`), read once for the whole load."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy
    from torch.distributed.checkpoint.planner import LoadPlan

    class SameLayoutLoadStrategy(torch_strategy.TorchDistLoadShardedStrategy):
        def load(self, sharded_state_dict: dict, checkpoint_dir: Any, async_strategy: str = "mcore") -> dict:
            plan = _same_layout_plan(sharded_state_dict, metadata)
            if not _everyone(plan is not None, device):
                return super().load(sharded_state_dict, checkpoint_dir, async_strategy)
            reader = torch_strategy._get_filesystem_reader(checkpoint_dir, cache_metadata=True)
            reader.set_up_storage_reader(metadata, is_coordinator=False)
            reader.read_data(LoadPlan(plan.items), plan).wait()
            self.cached_global_metadata = metadata
            loaded = {key: iter(objects) for key, objects in plan.objects.items()}

            def value(sh: Any) -> Any:
                if isinstance(sh, ShardedTensor):
                    return sh.data
                return next(loaded[sh.unique_key]) if isinstance(sh, ShardedObject) else sh

            return dict_list_map_inplace(value, sharded_state_dict)

    # cache_metadata: megatron's path then asks for the reader direct_tensor_reads provides
    return SameLayoutLoadStrategy(cache_metadata=True)
