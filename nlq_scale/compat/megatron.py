"""megatron-core internals: the CPU shim's patch points, the mends for the torch-Adam fallback
of the distributed optimizer, the writer processes of background saves, and a checkpoint load that
reads the optimizer state in place (runtime/cpu_shim.py, train/engine_megatron.py,
train/engine_deepspeed.py go through here)."""

from __future__ import annotations

import contextlib
import functools
import inspect
import io
import sys
import zipfile
from collections.abc import Callable, Iterator
from typing import Any

from nlq_scale.compat import Private

DISTRIBUTION = "megatron-core"
WRITTEN_FOR = "==0.16.*"  # read against 0.16.1

# Megatron modules whose tensor factories hard-code device='cuda' / pin_memory=True: the CPU shim
# replaces the module's `torch` global.
FACTORY_CALL_SITES = (
    "megatron.core.optimizer.optimizer",  # found_inf / grad-norm buffers on 'cuda'
    "megatron.core.optimizer.clip_grads",  # total_norm and dummy overflow buffers on 'cuda'
    "megatron.core.optimizer.distrib_optimizer",  # gbuf views, save buffers on current_device
    "megatron.core.utils",  # get_model_config / global memory buffer allocations
    "megatron.core.pipeline_parallel.schedules",  # p2p recv buffers and loss accumulators
    "megatron.core.pipeline_parallel.p2p_communication",  # recv tensors on current_device
    "megatron.core.distributed.finalize_model_grads",  # num_tokens / grad norms on 'cuda'
    "megatron.core.distributed.param_and_grad_buffer",  # warm-up tensor on 'cuda'
    "megatron.core.transformer.utils",  # default causal mask on 'cuda'
    "megatron.core.transformer.moe.moe_utils",  # aux-loss trackers on 'cuda'
    "megatron.core.tensor_parallel.data",  # broadcast sizes on 'cuda'
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",  # save-plan reuse flag on 'cuda'
)

# Modules that test `tensor.type() == 'torch.cuda.FloatTensor'` (and Half/BFloat16) to pick a code path.
TYPE_STRING_CALL_SITES = frozenset(
    {
        "megatron.core.optimizer.distrib_optimizer",  # _build_model_and_main_param_groups
        "megatron.core.optimizer.optimizer",  # Float16OptimizerWithFloat16Params
        "megatron.core.optimizer.clip_grads",  # clip_grad_by_total_norm_fp32 asserts cuda grads
    }
)

_RANDOM = "megatron.core.tensor_parallel.random"
_MOE_UTILS = "megatron.core.transformer.moe.moe_utils"
_DISTRIB = "megatron.core.optimizer.distrib_optimizer"
_BUFFER = "megatron.core.distributed.param_and_grad_buffer"
_ASYNC = "megatron.core.dist_checkpointing.strategies.async_utils"
_TORCH_STRATEGY = "megatron.core.dist_checkpointing.strategies.torch"

RELIES_ON = (
    Private(_RANDOM, "_get_cuda_rng_state", params=("device",)),
    Private(_RANDOM, "_set_cuda_rng_state", params=("new_state",)),
    *(Private(module, "torch") for module in sorted(set(FACTORY_CALL_SITES) | TYPE_STRING_CALL_SITES)),
    Private(f"{_MOE_UTILS}:RouterGatingLinearFunction", "forward"),  # reads the `te_general_gemm` global
    Private(f"{_MOE_UTILS}:MoEAuxLossAutoScaler", "main_loss_backward_scale"),
    Private(_DISTRIB, "HAVE_APEX_OR_TE"),
    Private(f"{_DISTRIB}:DistributedOptimizer", "_set_main_param_and_optimizer_states", params=("model_param", "tensors")),
    Private(f"{_DISTRIB}:DistributedOptimizer.__init__", "self.model_param_group_index_map", in_source=True),
    # unpadded_param_positions: the gathered state concatenates buckets' unpadded parts...
    Private(f"{_DISTRIB}:DistributedOptimizer.get_parameter_state_dp_zero",
            "offset_in_world_tensors += gbuf_world_numel_unpadded", in_source=True),
    # ...and the fully reshardable state slices it at the buffer's (padded) positions.
    Private(f"{_DISTRIB}:DistributedOptimizer.sharded_param_state_fully_reshardable",
            "in buffer.param_index_map.items()", in_source=True),
    Private(f"{_BUFFER}:_ParamAndGradBuffer.__init__", "self.param_index_map[param] = (", in_source=True),
    Private(f"{_BUFFER}:_ParamAndGradBucket.__init__", "self.offset = offset", in_source=True),
    Private(f"{_BUFFER}:_ParamAndGradBucket.__init__", "self.numel_unpadded = numel_unpadded", in_source=True),
    # in_place_optimizer_load: the fully reshardable format's two halves, replaced per optimizer...
    Private(f"{_DISTRIB}:DistributedOptimizer", "sharded_param_state_fully_reshardable",
            params=("model_sharded_state_dict", "is_loading", "metadata")),
    Private(f"{_DISTRIB}:DistributedOptimizer.sharded_state_dict",
            "self.sharded_param_state_fully_reshardable(", in_source=True),
    Private(f"{_DISTRIB}:DistributedOptimizer", "load_parameter_state_from_fully_reshardable", params=("state_dict",)),
    Private(f"{_DISTRIB}:DistributedOptimizer.load_state_dict",
            "self.load_parameter_state_from_fully_reshardable(param_state)", in_source=True),
    # ...its keys, and the ranges and live tensors it reads into.
    Private(f"{_DISTRIB}:DistributedOptimizer.sharded_param_state_fully_reshardable",
            "key=f'{prefix}.{state_key}.{sharded_metadata.key}'", in_source=True),
    Private(f"{_DISTRIB}:DistributedOptimizer.sharded_param_state_fully_reshardable",
            "prefix = 'optimizer.state'", in_source=True),
    Private(f"{_DISTRIB}:DistributedOptimizer.__init__", "self.gbuf_ranges", in_source=True),
    Private(f"{_DISTRIB}:DistributedOptimizer", "_get_main_param_and_optimizer_states", params=("model_param",)),
    Private(_DISTRIB, "HybridDeviceOptimizer"),
    # direct_tensor_reads: the reader megatron's torch_dist load strategy asks this module function for.
    Private(_TORCH_STRATEGY, "_get_filesystem_reader", params=("checkpoint_dir", "cache_metadata")),
    Private(f"{_TORCH_STRATEGY}:TorchDistLoadShardedStrategy.load",
            "_get_filesystem_reader(checkpoint_dir, cache_metadata=True)", in_source=True),
    Private(_TORCH_STRATEGY, "MultiStorageClientFeature"),
    Private("megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader",
            "CachedMetadataFileSystemReader"),
    # wait_for_async_writers: the queue's active calls and each one's writer process.
    Private(f"{_ASYNC}:AsyncCallsQueue.__init__", "self.async_calls", in_source=True),
    Private(f"{_ASYNC}:_ActiveAsyncRequest", "async_caller"),
    Private(f"{_ASYNC}:AsyncCaller", "close", params=("abort",)),
)


def replace_cuda_rng_state_functions(get_state: Callable[..., Any], set_state: Callable[..., Any]) -> None:
    """megatron's RNG tracker saves and restores "CUDA" states through these module functions."""
    from megatron.core.tensor_parallel import random

    for name, replacement in (("_get_cuda_rng_state", get_state), ("_set_cuda_rng_state", set_state)):
        current = getattr(random, name)
        if current is not replacement:
            # RELIES_ON checks upstream's signature, also in a process where the shim is applied.
            replacement.__wrapped__ = inspect.unwrap(current)
            setattr(random, name, replacement)


def bind_missing_te_general_gemm() -> None:
    """moe_utils.RouterGatingLinearFunction tests `te_general_gemm is not None`, but the name is
    never bound when Transformer Engine is absent (NameError): bind it to None."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def moe_aux_loss_scale() -> Any:
    """The aux-loss backward scale megatron's schedule keeps as class state (None before its first set)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    return MoEAuxLossAutoScaler.main_loss_backward_scale


def torch_adam_distributed_optimizers(optimizer: Any) -> list:
    """The distributed optimizers inside `optimizer` that run on torch's Adam (no Apex / Transformer
    Engine: the CPU path, and GPU nodes without either)."""
    from megatron.core.optimizer import distrib_optimizer

    return [] if distrib_optimizer.HAVE_APEX_OR_TE else distributed_optimizers(optimizer)


def keep_adam_step_when_loading_param_state(opt: Any) -> None:
    """Loading a fully reshardable state copies every key of the live Adam state from the
    checkpoint's per-parameter tensors, which never hold `step` (KeyError 'step' in 0.16.1): copy
    the others and leave `step` to load_state_dict."""
    original = opt._set_main_param_and_optimizer_states

    def set_states(model_param, tensors):
        group_index, group_order = opt.model_param_group_index_map[model_param]
        state = opt.optimizer.state[opt.optimizer.param_groups[group_index]["params"][group_order]]
        step = state.pop("step", None)
        try:
            original(model_param, tensors)
        finally:
            if step is not None:
                state["step"] = step

    opt._set_main_param_and_optimizer_states = set_states


def distributed_optimizers(optimizer: Any) -> list:
    from megatron.core.optimizer import distrib_optimizer

    chain = getattr(optimizer, "chained_optimizers", [optimizer])
    return [o for o in chain if isinstance(o, distrib_optimizer.DistributedOptimizer)]


@contextlib.contextmanager
def unpadded_param_positions(optimizer: Any) -> Iterator[None]:
    """megatron-core 0.16.1's fully reshardable optimizer state gathers every bucket's unpadded part
    into one tensor, then slices each parameter out at its position in the *padded* buffer. With
    more than one bucket (PP > 1 gives the shared embedding its own bucket) every parameter behind a
    padded bucket end reads values shifted by that padding: the checkpoint holds wrong main params
    and moments, and a resume loads them into the model (seen: the embedding shifted by one row,
    loss 9.6 -> 10.5). Within the block, positions index the concatenation; with one bucket they
    are unchanged."""
    saved = []
    for opt in distributed_optimizers(optimizer):
        for buffer in opt.buffers:
            starts, total = [], 0
            for bucket in buffer.buckets:
                starts.append(total - bucket.offset)
                total += bucket.numel_unpadded
            saved.append((buffer, buffer.param_index_map))
            buffer.param_index_map = {
                param: (start + starts[b], end + starts[b], b)
                for param, (start, end, b) in buffer.param_index_map.items()
            }
    try:
        yield
    finally:
        for buffer, positions in saved:
            buffer.param_index_map = positions


def wait_for_async_writers(queue: Any) -> None:
    """Join the writer processes of an AsyncCallsQueue's background saves on this rank alone, and
    forget the saves: their finalization is collective, which a rank on its way out cannot count on."""
    for call in queue.async_calls:
        call.async_caller.close()
    queue.async_calls.clear()


def _owned_param_ranges(opt: Any, gbuf_idx: int) -> dict:
    """This rank's part of each parameter it owns in buffer `gbuf_idx`: param -> its range map."""
    (ranges_for_all_buckets,) = opt.gbuf_ranges[gbuf_idx].values()  # one dtype per buffer (megatron asserts it)
    owned = {}
    for ranges in ranges_for_all_buckets:
        owned.update(ranges["param_map"])
    return owned


def _in_place_param_state(opt: Any, model_sharded_state_dict: Any) -> dict:
    """The loading side of megatron's fully reshardable optimizer state, without its full-model
    buffers: the same checkpoint keys (optimizer.state.<param|exp_avg|exp_avg_sq>.<model key>, each
    of its model parameter's shape and sharding), but only for the parameters this rank owns, and
    read straight into the optimizer's own tensors where this rank owns a whole, contiguous fp32
    parameter (always at DP=1); a parameter split across DP ranks is read into a temporary of its
    local shape and sliced (`_load_in_place_param_state`), as megatron does for every parameter.
    A main param that is a view of its fp32 model parameter (fp32 training: the optimizer steps the
    model's own memory) is not read again: the model's weight, loaded beside it from the same
    checkpoint, holds the same bits (a run cannot resume at another precision: model.bf16 is part
    of its identity)."""
    from dataclasses import replace

    import torch
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    sharded, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    by_param = {sh.data: sh for sh in nested_values(sharded)}
    state, param_idx = {}, 0
    for gbuf_idx, buffer in enumerate(opt.buffers):
        owned = _owned_param_ranges(opt, gbuf_idx)
        for model_param in buffer.param_index_map:  # megatron's order: the in-memory keys match its own
            tensors = {}
            if model_param in owned:
                meta = by_param[model_param]
                assert meta.flattened_range is None, f"flattened model tensor not supported ({meta})"
                part = owned[model_param]["param"]
                whole = part.start == 0 and part.end == model_param.numel()
                live = opt._get_main_param_and_optimizer_states(model_param)
                for key in ("param", "exp_avg", "exp_avg_sq"):
                    target = live[key]
                    if key == "param" and _aliases(target, model_param, part):
                        continue
                    if whole and target.dtype == torch.float32 and target.is_contiguous():
                        data = target.detach().view(meta.data.shape)
                    else:
                        data = torch.empty(meta.data.shape, dtype=torch.float32, device=target.device)
                    kwargs = dict(key=f"optimizer.state.{key}.{meta.key}", data=data, dtype=data.dtype,
                                  replica_id=_owner_replica_id(meta.replica_id, first_owner=part.start == 0))  # fmt: skip
                    if isinstance(meta, ShardedTensorFactory):
                        kwargs.pop("dtype")
                    tensors[key] = replace(meta, **kwargs)
                    tensors[key].validate_metadata_integrity()
            state[param_idx] = tensors
            param_idx += 1
    return state


def _owner_replica_id(model_replica_id: Any, first_owner: bool) -> Any:
    """The replica id of an optimizer state only its owners request. megatron's model tensors end
    their replica id with the DP rank, and its load validation wants exactly one main replica
    (all zeros) per shard: there DP rank 0, which here may own none of the parameter. So the rank
    owning the parameter's first element (DP ranks own ascending ranges of the buffer: it is the
    lowest of its owners) reads as the main DP replica, any other owner as not."""
    dp = 0 if first_owner else 1
    if isinstance(model_replica_id, int):
        return dp
    return (*model_replica_id[:-1], dp)


def _aliases(main_param: Any, model_param: Any, part: Any) -> bool:
    """Whether this main param is the fp32 model parameter's own memory (its `part`): fp32 training,
    where megatron's distributed optimizer steps views of the model's parameters."""
    import torch

    return (
        model_param.dtype == main_param.dtype == torch.float32
        and model_param.is_contiguous()
        and main_param.numel() == part.end - part.start
        and main_param.data_ptr() == model_param.data_ptr() + part.start * model_param.element_size()
    )


def _load_in_place_param_state(opt: Any, state_dict: dict) -> None:
    """The inverse of `_in_place_param_state`: copy what was read into a temporary (a parameter split
    across DP ranks, a non-fp32 or strided state, a tensor a factory merged) into this rank's slice;
    what was read in place is already there."""
    import torch

    param_idx = 0
    with torch.no_grad():
        for gbuf_idx, buffer in enumerate(opt.buffers):
            owned = _owned_param_ranges(opt, gbuf_idx)
            for model_param in buffer.param_index_map:
                loaded = state_dict.get(param_idx, {})  # a parameter this rank does not own: nothing asked
                param_idx += 1
                if model_param not in owned:
                    continue
                part = owned[model_param]["param"]
                live = opt._get_main_param_and_optimizer_states(model_param)
                for key, value in loaded.items():
                    target = live[key]
                    if value.data_ptr() == target.data_ptr() and value.numel() == target.numel():
                        continue  # read in place
                    target.copy_(value.flatten()[part.start : part.end])


@contextlib.contextmanager
def in_place_optimizer_load(optimizer: Any) -> Iterator[None]:
    """While loading a fully reshardable optimizer state: each distributed optimizer requests its
    parameters' states in place (`_in_place_param_state`) instead of gathering full-model buffers on
    every rank and copying out of them. The checkpoint format and the resharding across TP, PP and
    DP are megatron's: only where the bytes land changes. Optimizers this does not cover (precision-
    aware, CPU-offloading) keep megatron's path."""
    from megatron.core.optimizer.distrib_optimizer import HybridDeviceOptimizer

    patched = []
    for opt in distributed_optimizers(optimizer):
        if opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 or isinstance(opt.optimizer, HybridDeviceOptimizer):
            continue
        saving = opt.sharded_param_state_fully_reshardable

        def request(model_sharded_state_dict, is_loading=False, metadata=None, _opt=opt, _saving=saving):
            if not is_loading:
                return _saving(model_sharded_state_dict, is_loading, metadata)
            return _in_place_param_state(_opt, model_sharded_state_dict)

        opt.sharded_param_state_fully_reshardable = request
        opt.load_parameter_state_from_fully_reshardable = functools.partial(_load_in_place_param_state, opt)
        patched.append(opt)
    try:
        yield
    finally:
        for opt in patched:
            del opt.sharded_param_state_fully_reshardable
            del opt.load_parameter_state_from_fully_reshardable


class _Window(io.RawIOBase):
    """Bytes [start, start + length) of a seekable binary stream, as a stream of their own: one
    stored item of a checkpoint file, for torch.load and zipfile (torch's own file view takes a
    seek from the end the wrong way round, and zipfile makes one)."""

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


def _saved_little_endian(item: _Window) -> bool:
    """Whether a torch.save'd item records that it was written little-endian (torch.save writes
    the host's byte order into the archive; torch.load swaps the bytes when it differs)."""
    with zipfile.ZipFile(item) as archive:
        marks = [name for name in archive.namelist() if name.rsplit("/", 1)[-1] == "byteorder"]
        return len(marks) == 1 and archive.read(marks[0]) == b"little"


def _direct_reader_class() -> type:
    """dist_checkpointing's cached-metadata reader, reading a whole stored tensor straight into the
    tensor it is loaded into. torch.distributed.checkpoint's FileSystemReader torch.loads each stored
    tensor into new memory and then copies it into place; here the item's header alone is
    unpickled (weights-only, onto the meta device: dtype, shape, strides and where the storage
    record starts), and when the item is one contiguous little-endian tensor of the target's dtype
    and shape that the target takes whole, its bytes are read into the target. Anything else —
    transformed (compressed) items, partial reads (resharding), strided or other-dtype targets,
    tensor subclasses, big-endian files or hosts — goes through torch's own read_data."""
    import dataclasses

    import torch
    from megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader import (
        CachedMetadataFileSystemReader,
    )
    from torch.distributed.checkpoint.planner import LoadItemType

    def stored_tensor_offset(item: _Window, target: torch.Tensor) -> int | None:
        """Where in `item` the bytes of a tensor laid out exactly as `target` start; None if the
        stored tensor is laid out otherwise."""
        stored = torch.load(item, map_location="meta", weights_only=True)
        if type(stored) is not torch.Tensor:
            return None
        storage = stored.untyped_storage()
        offset = getattr(storage, "_checkpoint_offset", None)
        same = (
            stored.dtype == target.dtype
            and stored.shape == target.shape
            and stored.numel() > 0
            and stored.is_contiguous()
            and stored.storage_offset() == 0
            and storage.nbytes() == target.numel() * target.element_size()
        )
        return offset if same and offset is not None and _saved_little_endian(item) else None

    def read_exactly(stream: Any, offset: int, target: torch.Tensor, relative_path: str) -> None:
        view = memoryview(target.view(-1).view(torch.uint8).numpy())
        stream.seek(offset)
        done = 0
        while done < len(view):
            n = stream.readinto(view[done:])
            if not n:
                raise EOFError(f"{relative_path}: truncated tensor at byte {offset + done}")
            done += n

    class DirectTensorReader(CachedMetadataFileSystemReader):
        def _direct(self, stream: Any, req: Any, planner: Any) -> tuple[torch.Tensor, int] | None:
            """The tensor `req` reads into and where in the file its bytes start, when the read can
            go straight there; None when torch's path must read it."""
            item_md = self.storage_data[req.storage_index]
            if req.type != LoadItemType.TENSOR or item_md.transform_descriptors or any(req.storage_offsets):
                return None
            target = planner.resolve_tensor(req).detach()
            if type(target) is not torch.Tensor or target.device.type != "cpu" or not target.is_contiguous():
                return None
            offset = stored_tensor_offset(_Window(stream, item_md.offset, item_md.length), target)
            return None if offset is None else (target, item_md.offset + offset)

        def read_data(self, plan, planner):
            if sys.byteorder != "little":
                return super().read_data(plan, planner)
            per_file: dict[str, list] = {}
            for req in plan.items:
                per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
            rest = []
            for relative_path, reqs in per_file.items():
                with self.fs.create_stream(self.fs.concat_path(self.path, relative_path), "rb") as stream:
                    for req in reqs:
                        direct = self._direct(stream, req, planner)
                        if direct is None:
                            rest.append(req)
                            continue
                        read_exactly(stream, direct[1], direct[0], relative_path)
                        planner.commit_tensor(req, direct[0])
            return super().read_data(dataclasses.replace(plan, items=rest), planner)

    return DirectTensorReader


@contextlib.contextmanager
def direct_tensor_reads() -> Iterator[None]:
    """dist_checkpointing.load through `_direct_reader_class`'s reader (megatron's torch_dist load
    strategy gets its reader from this module function; multi-storage-client paths keep theirs)."""
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy

    original = torch_strategy._get_filesystem_reader
    reader = _direct_reader_class()

    def get_reader(checkpoint_dir, cache_metadata=False):
        if cache_metadata and not torch_strategy.MultiStorageClientFeature.is_enabled():
            return reader(checkpoint_dir)
        return original(checkpoint_dir, cache_metadata)

    torch_strategy._get_filesystem_reader = get_reader
    try:
        yield
    finally:
        torch_strategy._get_filesystem_reader = original
