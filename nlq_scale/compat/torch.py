"""torch internals: the weak tensor-keyed dict the device check uses, stopping a DataLoader's
worker processes, the private names and plain-pickle read of torch.distributed.checkpoint
metadata that train/untrusted.py guards, and reading what a torch.save'd tensor's header says
(runtime/device_check.py, data/loader.py, train/untrusted.py and compat/megatron_load.py go through
here)."""

from __future__ import annotations

import collections
import io
import pickle
import struct
import zipfile
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from nlq_scale.compat import Private

DISTRIBUTION = "torch"
WRITTEN_FOR = ">=2.6,<2.16"  # read against 2.15.0; the floor is megatron-core's

# Globals besides dataclasses, enums and torch constants that torch.distributed.checkpoint's
# `.metadata` pickles: (module, name) pairs.
DCP_METADATA_GLOBALS = frozenset({("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")})

RELIES_ON = (
    Private("torch.utils.weak", "WeakTensorKeyDictionary"),
    Private("torch.serialization", "_get_layout", params=("name",)),
    # untrusted.check_metadata exists because of this: `.metadata` is read with plain pickle.
    Private("torch.distributed.checkpoint.filesystem:FileSystemReader.read_metadata", "pickle.load(", in_source=True),
    Private("torch.utils.data.dataloader:_MultiProcessingDataLoaderIter", "_shutdown_workers", params=()),
    # compat.megatron_load.direct_tensor_reads: a torch.distributed.checkpoint item is a torch.save'd tensor
    # at (offset, length) of its file, which torch's reader torch.loads (stored_tensor reads its header).
    Private("torch.distributed.checkpoint.filesystem:FileSystemReader.read_data",
            "torch.load(", in_source=True),
    Private("torch.distributed.checkpoint.filesystem:FileSystemReader.read_data",
            "item_md.transform_descriptors", in_source=True),
    # stored_tensor: what torch.save writes for one tensor (its pickle's one call, the persistent id
    # of its storage, and the host's byte order as a record of its own).
    Private("torch._utils", "_rebuild_tensor_v2",
            params=("storage", "storage_offset", "size", "stride", "requires_grad", "backward_hooks")),
    Private("torch._tensor:Tensor._reduce_ex_internal", "torch._utils._rebuild_tensor_v2", in_source=True),
    Private("torch.serialization:_save", '("storage", storage_type, storage_key, location, storage_numel)',
            in_source=True),
    Private("torch.serialization:_save", 'write_record("byteorder"', in_source=True),
)

# torch.save's typed storages, by the name its pickle gives them: the dtypes a checkpoint holds.
STORAGE_DTYPES = {
    "FloatStorage": torch.float32, "DoubleStorage": torch.float64, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8, "BoolStorage": torch.bool,
}  # fmt: skip


def stop_loader_workers(batches: Any) -> None:
    """Stop the worker processes of a DataLoader iterator now (torch does it only when the iterator
    is garbage-collected); an iterator without workers has nothing to stop."""
    shutdown = getattr(batches, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


@dataclass(frozen=True)
class StoredTensor:
    """What the header of a torch.save'd tensor says of it; `data_offset` is where its storage's
    bytes start in the saved file (uncompressed, in the byte order `little_endian` says)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    storage_nbytes: int
    data_offset: int
    little_endian: bool

    def is_whole_contiguous(self) -> bool:
        """Whether the storage holds exactly this tensor's elements, in row-major order (torch's
        contiguity: the strides of size-1 dimensions do not matter)."""
        if len(self.shape) != len(self.stride):
            return False
        expected = 1
        for size, stride in reversed(list(zip(self.shape, self.stride))):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return self.storage_offset == 0 and expected > 0 and self.storage_nbytes == expected * self.dtype.itemsize


def _rebuilt(storage, storage_offset, size, stride, requires_grad, backward_hooks, metadata=None) -> tuple:
    if backward_hooks or metadata:
        raise pickle.UnpicklingError("a tensor with hooks or metadata")
    return storage, storage_offset, tuple(size), tuple(stride)


class _TensorHeader(pickle.Unpickler):
    """Unpickles the data.pkl of a torch.save'd plain tensor into what it says, building nothing:
    the only globals it resolves are the rebuild call (to `_rebuilt`, which records its arguments),
    OrderedDict (its hooks) and the typed storages (to their dtype); any other is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuilt
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name in STORAGE_DTYPES:
            return STORAGE_DTYPES[name]
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        return pid


_LOCAL_HEADER = struct.Struct("<4s22xHH")  # a zip local file header: signature ... name, extra lengths
# The end-of-central-directory record: signature ... entries, directory size and offset, comment length.
_END = struct.Struct("<4s6xHLLH")
# A central directory entry: signature ... method ... sizes, name/extra/comment lengths ... local header offset.
_ENTRY = struct.Struct("<4s6xH8xLLHHH8xL")
_SPILL = 0xFFFFFFFF  # a size or offset zip64 moved to an extra field
_TAIL = 4096  # torch.save's directory for one tensor (seven records) takes ~600 bytes
_HEAD_SLACK = 1024  # the local headers (names, alignment padding) before and after the small records


def _directory(item: Any) -> dict[str, tuple[int, int, int]] | None:
    """Record name (after the archive's top folder) -> (local header offset, size, compression
    method), from the zip's central directory read from the end of `item` in one read; None for an
    archive this does not parse (a comment, zip64 sizes or offsets, a directory beyond the tail)."""
    end = item.seek(0, io.SEEK_END)
    start = max(0, end - _TAIL)
    item.seek(start)
    tail = item.read(end - start)
    if len(tail) < _END.size:
        return None
    signature, count, size, offset, comment = _END.unpack_from(tail, len(tail) - _END.size)
    pos = offset - start
    if signature != b"PK\x05\x06" or comment or offset == _SPILL or pos < 0:
        return None
    records = {}
    for _ in range(count):
        if pos + _ENTRY.size > len(tail):
            return None
        signature, method, packed, unpacked, name, extra, note, local = _ENTRY.unpack_from(tail, pos)
        if signature != b"PK\x01\x02" or _SPILL in (packed, unpacked, local):
            return None
        full = tail[pos + _ENTRY.size : pos + _ENTRY.size + name].decode("utf-8", "replace")
        records[full.partition("/")[2]] = (local, unpacked, method)
        pos += _ENTRY.size + name + extra + note
    return records


def _record_start(item: Any, head: bytes, local: int) -> int | None:
    """Where the bytes of the record whose local header is at `local` start: parsed from `head`
    (the item's first bytes) where it holds the header, else read."""
    header = head[local : local + _LOCAL_HEADER.size]
    if len(header) < _LOCAL_HEADER.size:
        item.seek(local)
        header = item.read(_LOCAL_HEADER.size)
    if len(header) < _LOCAL_HEADER.size:
        return None
    signature, name, extra = _LOCAL_HEADER.unpack(header)
    return local + _LOCAL_HEADER.size + name + extra if signature == b"PK\x03\x04" else None


def _contents(item: Any, head: bytes, record: tuple[int, int, int]) -> bytes | None:
    """A small stored record's bytes, from `head` (where torch.save puts its small records)."""
    local, size, method = record
    at = _record_start(item, head, local)
    if method != zipfile.ZIP_STORED or at is None or at + size > len(head):
        return None
    return head[at : at + size]


def stored_tensor(item: Any) -> StoredTensor | None:
    """What the header of the one tensor torch.save wrote into `item` (a seekable binary stream
    holding that file) says, parsed without unpickling through torch or reading its data, or None
    when `item` holds anything else (a parameter, a container, a compressed storage, another
    format): torch.load, which also reads those, is several times slower for the header alone.
    zipfile, too, took most of a same-layout load's own time: here two reads, the directory at the
    end and the small records at the start. Used to read a stored tensor's bytes straight into
    memory of its own."""
    records = _directory(item)
    if records is None or not {"data.pkl", "byteorder"} <= records.keys():
        return None
    small = (records["data.pkl"], records["byteorder"])
    item.seek(0)
    head = item.read(max(local + size for local, size, _ in small) + _HEAD_SLACK)
    pickled, byteorder = (_contents(item, head, record) for record in small)
    if pickled is None or byteorder not in (b"little", b"big"):
        return None
    try:
        storage, storage_offset, shape, stride = _TensorHeader(io.BytesIO(pickled)).load()
        kind, dtype, key, _location, numel = storage
    except (pickle.UnpicklingError, ValueError, TypeError, EOFError):
        return None
    if kind != "storage" or dtype not in STORAGE_DTYPES.values():
        return None
    if not all(type(n) is int for n in (numel, storage_offset, *shape, *stride)):
        return None
    data = records.get(f"data/{key}")
    if data is None:
        return None
    local, size, method = data
    if method != zipfile.ZIP_STORED or size != numel * dtype.itemsize:
        return None
    data_offset = _record_start(item, head, local)
    if data_offset is None:
        return None
    return StoredTensor(
        dtype=dtype,
        shape=shape,
        stride=stride,
        storage_offset=storage_offset,
        storage_nbytes=size,
        data_offset=data_offset,
        little_endian=byteorder == b"little",
    )


__all__ = ["DCP_METADATA_GLOBALS", "StoredTensor", "WeakTensorKeyDictionary", "stop_loader_workers", "stored_tensor"]
