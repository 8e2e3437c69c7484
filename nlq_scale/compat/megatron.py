"""megatron-core internals: the CPU shim's patch points, the mends for the torch-Adam fallback
of the distributed optimizer, checkpoint writes in this process (no forked writers),
checkpoints that save the optimizer state from, and load it into, the optimizer's own tensors,
and loads in the saved layout without resharding plans (runtime/cpu_shim.py,
train/engine_megatron.py, train/engine_deepspeed.py go through here)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import inspect
import io
import queue
import sys
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
_TORCH_STRATEGY = "megatron.core.dist_checkpointing.strategies.torch"
_CLIP_GRADS = "megatron.core.optimizer.clip_grads"
_FS_ASYNC = "megatron.core.dist_checkpointing.strategies.filesystem_async"
_CHECKPOINTABLE = "megatron.core.dist_checkpointing.strategies.checkpointable"

RELIES_ON = (
    Private(_RANDOM, "_get_cuda_rng_state", params=("device",)),
    Private(_RANDOM, "_set_cuda_rng_state", params=("new_state",)),
    # device_grad_norm_fallback: the norm function the grad clipping calls, and the fallback it replaces.
    Private(_CLIP_GRADS, "l2_norm_impl"),
    Private(f"{_CLIP_GRADS}:get_grad_norm_fp32", "l2_norm_impl,", in_source=True),
    Private("megatron.core.utils", "local_multi_tensor_l2_norm",
            params=("chunk_size", "noop_flag", "tensor_lists", "per_tensor")),
    *(Private(module, "torch") for module in sorted(set(FACTORY_CALL_SITES) | TYPE_STRING_CALL_SITES)),
    Private(f"{_MOE_UTILS}:RouterGatingLinearFunction", "forward"),  # reads the `te_general_gemm` global
    Private(f"{_MOE_UTILS}:MoEAuxLossAutoScaler", "main_loss_backward_scale"),
    Private(_DISTRIB, "HAVE_APEX_OR_TE"),
    Private(f"{_DISTRIB}:DistributedOptimizer", "_set_main_param_and_optimizer_states", params=("model_param", "tensors")),
    Private(f"{_DISTRIB}:DistributedOptimizer.__init__", "self.model_param_group_index_map", in_source=True),
    # in_place_optimizer_state: the fully reshardable format's two halves, replaced per optimizer...
    Private(f"{_DISTRIB}:DistributedOptimizer", "sharded_param_state_fully_reshardable",
            params=("model_sharded_state_dict", "is_loading", "metadata")),
    Private(f"{_DISTRIB}:DistributedOptimizer.sharded_state_dict",
            "self.sharded_param_state_fully_reshardable(", in_source=True),
    Private(f"{_DISTRIB}:DistributedOptimizer", "load_parameter_state_from_fully_reshardable", params=("state_dict",)),
    Private(f"{_DISTRIB}:DistributedOptimizer.load_state_dict",
            "self.load_parameter_state_from_fully_reshardable(param_state)", in_source=True),
    # ...its keys and parameter order, and the ranges, live tensors and DP group it saves from and reads into.
    Private(f"{_DISTRIB}:DistributedOptimizer.sharded_param_state_fully_reshardable",
            "in buffer.param_index_map.items()", in_source=True),
    Private(f"{_BUFFER}:_ParamAndGradBuffer.__init__", "self.param_index_map[param] = (", in_source=True),
    Private(f"{_DISTRIB}:DistributedOptimizer.sharded_param_state_fully_reshardable",
            "key=f'{prefix}.{state_key}.{sharded_metadata.key}'", in_source=True),
    Private(f"{_DISTRIB}:DistributedOptimizer.sharded_param_state_fully_reshardable",
            "prefix = 'optimizer.state'", in_source=True),
    Private(f"{_DISTRIB}:DistributedOptimizer.__init__", "self.gbuf_ranges", in_source=True),
    Private(f"{_DISTRIB}:DistributedOptimizer.__init__", "self.data_parallel_group = data_parallel_group", in_source=True),
    Private(f"{_DISTRIB}:DistributedOptimizer.__init__", "self.ddp_config = self.model_chunks[0].ddp_config", in_source=True),
    Private(f"{_DISTRIB}:DistributedOptimizer", "_get_main_param_and_optimizer_states", params=("model_param",)),
    Private(_DISTRIB, "HybridDeviceOptimizer"),
    # direct_tensor_reads: the reader megatron's torch_dist load strategy asks this module function for.
    Private(_TORCH_STRATEGY, "_get_filesystem_reader", params=("checkpoint_dir", "cache_metadata")),
    Private(f"{_TORCH_STRATEGY}:TorchDistLoadShardedStrategy.load",
            "_get_filesystem_reader(checkpoint_dir, cache_metadata=True)", in_source=True),
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
    Private("megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader",
            "CachedMetadataFileSystemReader"),
    # in_process_writes: the writer's per-bucket write, the forking function that calls it, and the
    # results queue it is handed.
    Private(f"{_FS_ASYNC}:FileSystemWriterAsync", "write_preloaded_data",
            params=("transform_list", "local_proc_idx", "write_bucket", "results_queue", "count_queue", "use_fsync")),
    Private(f"{_FS_ASYNC}:FileSystemWriterAsync", "write_preloaded_data_multiproc",
            params=("transform_list", "use_msc", "rank", "write_buckets", "global_results_queue")),
    Private(f"{_FS_ASYNC}:FileSystemWriterAsync.get_save_function_and_args",
            "partial(self.write_preloaded_data_multiproc,", in_source=True),
    Private(_FS_ASYNC, "_get_write_results_queue"),
    Private(f"{_FS_ASYNC}:FileSystemWriterAsync.get_save_function_and_args",
            "[torch.distributed.get_rank(), self.write_buckets, self.results_queue]", in_source=True),
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


def device_grad_norm_fallback() -> None:
    """Without Apex or Transformer Engine, megatron's gradient norm falls back to
    utils.local_multi_tensor_l2_norm, which builds a host tensor from the list of per-parameter
    device norms: one device-to-host copy and synchronization per parameter tensor per step on a GPU
    (107 a step for the 124M linear arm, 167 for nonlinear, in the profile of docs/performance.md).
    This replaces that fallback, and only it, with the same norm computed on the device."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = _l2_norm_on_device


def _l2_norm_on_device(chunk_size: int, noop_flag: Any, tensor_lists: list, per_tensor: bool, *args: Any) -> tuple:
    """local_multi_tensor_l2_norm's result (the 2-norm of all tensors in tensor_lists, a float32
    tensor of shape [1] on their device, and no per-tensor norms) without leaving the device."""
    import torch

    tensors = [t for tensor_list in tensor_lists for t in tensor_list]
    return torch.nn.utils.get_total_norm(tensors, norm_type=2.0).reshape(1).float(), None


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
def in_process_writes() -> Iterator[None]:
    """dist_checkpointing.save whose writer runs in this process, one thread per write bucket,
    instead of forking a process per bucket that reports through a multiprocessing Manager (spawned
    on the first save). On a CPU the forks and the Manager's round trips cost as much as the write
    itself (docs/performance.md, "Checkpoints"). Files, fsyncs and results stay megatron's: its own
    per-bucket function writes each bucket. A background save made in this context is written by
    `staged_write`'s call."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    writer = filesystem_async.FileSystemWriterAsync
    original_write = writer.__dict__["write_preloaded_data_multiproc"]
    original_queue = filesystem_async._get_write_results_queue
    writer.write_preloaded_data_multiproc = staticmethod(_write_buckets_in_threads)
    filesystem_async._get_write_results_queue = queue.SimpleQueue
    try:
        yield
    finally:
        writer.write_preloaded_data_multiproc = original_write
        filesystem_async._get_write_results_queue = original_queue


def _write_buckets_in_threads(
    transform_list: list, use_msc: bool, rank: int, write_buckets: list, global_results_queue: Any
) -> None:
    """write_preloaded_data_multiproc's contract (every bucket's results by index, or the first
    exception, put on global_results_queue, where the save's finalization raises it on every rank)
    with threads for processes."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    results: queue.Queue = queue.Queue()
    done: queue.Queue = queue.Queue()
    extra = {"use_msc": True} if use_msc else {}

    def write(index: int, bucket: Any) -> None:
        done.put(index)  # the function takes one item off this queue when it ends
        FileSystemWriterAsync.write_preloaded_data(transform_list, index, bucket, results, done, True, **extra)

    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(write_buckets)) as pool:
            list(pool.map(write, range(len(write_buckets)), write_buckets))
        written = dict(sorted(results.get_nowait() for _ in write_buckets))  # by bucket index
        failed = [w for w in written.values() if isinstance(w, Exception)]
        global_results_queue.put(failed[0] if failed else written)
    except Exception as error:  # noqa: BLE001 - reported where megatron reports a writer's failure
        global_results_queue.put(error)


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


_STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")  # megatron's fully reshardable keys, per parameter


def _owned_params(opt: Any) -> Iterator[tuple[int, Any, Any]]:
    """(megatron's index of the parameter in its fully reshardable state, model param, this rank's
    range of it) for every parameter this rank's optimizer shard holds a part of."""
    param_idx = 0
    for gbuf_idx, buffer in enumerate(opt.buffers):
        (ranges_for_all_buckets,) = opt.gbuf_ranges[gbuf_idx].values()  # one dtype per buffer (megatron asserts it)
        owned = {param: ranges for bucket in ranges_for_all_buckets for param, ranges in bucket["param_map"].items()}
        for model_param in buffer.param_index_map:  # megatron's order: the in-memory keys match its own
            if model_param in owned:
                yield param_idx, model_param, owned[model_param]["param"]
            param_idx += 1


def _whole(model_param: Any, part: Any) -> bool:
    return part.start == 0 and part.end == model_param.numel()


def _split_param_states(opt: Any) -> dict:
    """The full fp32 states of each parameter split across DP ranks, assembled on the rank holding
    its first element from its other owners' parts (point to point, in an order every DP rank
    derives alike: what megatron's full-model gather does for every parameter, done for these
    few): model param -> {key: tensor of the parameter's numel}. Collective over the optimizer's
    DP group."""
    import torch
    import torch.distributed as dist

    group = opt.data_parallel_group
    params, mine = {}, {}
    for idx, param, part in _owned_params(opt):
        if not _whole(param, part):
            params[idx], mine[idx] = param, (part.start, part.end)
    everyone: list = [None] * group.size()
    dist.all_gather_object(everyone, mine, group=group)
    me, assembled = group.rank(), {}
    for idx in sorted(set().union(*everyone)):
        owners = [r for r, parts in enumerate(everyone) if idx in parts]
        if me not in owners:
            continue
        live = opt._get_main_param_and_optimizer_states(params[idx])
        if me != owners[0]:
            for key in _STATE_KEYS:
                part = live[key].detach().float().contiguous()
                dist.send(part, dst=dist.get_global_rank(group, owners[0]), group=group)
            continue
        device = live["param"].device
        full = {key: torch.empty(params[idx].numel(), dtype=torch.float32, device=device) for key in _STATE_KEYS}
        start, end = mine[idx]
        for key in _STATE_KEYS:
            full[key][start:end].copy_(live[key].detach())
            for owner in owners[1:]:
                o_start, o_end = everyone[owner][idx]
                dist.recv(full[key][o_start:o_end], src=dist.get_global_rank(group, owner), group=group)
        assembled[params[idx]] = full
    return assembled


def _in_place_param_state(
    opt: Any, model_sharded_state_dict: Any, is_loading: bool = False, metadata: Any = None
) -> dict:
    """megatron's fully reshardable optimizer state without its full-model buffers: the same
    checkpoint keys (optimizer.state.<param|exp_avg|exp_avg_sq>.<model key>, each of its model
    parameter's shape and sharding, fp32), but built only from, and read only into, the parameters
    this rank owns. A parameter this rank owns whole (at DP=1, all of them) is saved from and read
    straight into the optimizer's own tensors; one split across DP ranks is saved by its first
    owner from the parts `_split_param_states` brings together, and read whole by each owner into
    a temporary and sliced (`_load_in_place_param_state`), as megatron does for every parameter.
    Loading, a main param that is a view of its fp32 model parameter (fp32 training: the optimizer
    steps the model's own memory) is not read again: the model's weight, loaded beside it from the
    same checkpoint, holds the same bits (a run cannot resume at another precision: model.bf16 is
    part of its identity). `metadata` (which of megatron's gathers to use) has nothing to pick here."""
    from dataclasses import replace

    import torch
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    sharded, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    by_param = {sh.data: sh for sh in nested_values(sharded)}
    split = {} if is_loading else _split_param_states(opt)
    state = {idx: {} for idx in range(sum(len(b.param_index_map) for b in opt.buffers))}
    for idx, model_param, part in _owned_params(opt):
        meta = by_param[model_param]
        assert meta.flattened_range is None, f"flattened model tensor not supported ({meta})"
        whole = _whole(model_param, part)
        if not (is_loading or whole or model_param in split):
            continue  # saved by its first owner
        live = opt._get_main_param_and_optimizer_states(model_param)
        for key in _STATE_KEYS:
            target = live[key]
            if is_loading and key == "param" and _aliases(target, model_param, part):
                continue
            data = _state_data(target, model_param.numel(), whole, split.get(model_param, {}).get(key), is_loading)
            kwargs = dict(key=f"optimizer.state.{key}.{meta.key}", data=data.reshape(meta.data.shape),
                          dtype=torch.float32, replica_id=_owner_replica_id(meta.replica_id, part.start == 0))  # fmt: skip
            if isinstance(meta, ShardedTensorFactory):
                kwargs.pop("dtype")
            state[idx][key] = replace(meta, **kwargs)
            state[idx][key].validate_metadata_integrity()
    return state


def _state_data(target: Any, numel: int, whole: bool, assembled: Any, is_loading: bool) -> Any:
    """The fp32 tensor a parameter's state is saved from or read into: the optimizer's own where it
    holds the whole parameter in fp32; for a split parameter the parts `assembled` (saving) or a
    temporary read whole and sliced after (loading); a state kept in another dtype or layout is
    saved as an fp32 copy and read into a temporary."""
    import torch

    if whole and target.dtype == torch.float32 and target.is_contiguous():
        return target.detach()
    if not is_loading:
        return target.detach().float() if whole else assembled
    return torch.empty(target.shape if whole else numel, dtype=torch.float32, device=target.device)


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
    across DP ranks, a non-fp32 or strided state, a tensor a factory merged) into this rank's part;
    what was read in place is already there."""
    import torch

    with torch.no_grad():
        for idx, model_param, part in _owned_params(opt):
            live = opt._get_main_param_and_optimizer_states(model_param)
            for key, value in state_dict[idx].items():
                target = live[key]
                if value.data_ptr() == target.data_ptr() and value.numel() == target.numel():
                    continue  # read in place
                target.copy_(value.flatten()[part.start : part.end])


@contextlib.contextmanager
def in_place_optimizer_state(optimizer: Any) -> Iterator[None]:
    """While building a fully reshardable optimizer state to save or load: each distributed
    optimizer saves it from and loads it into its own tensors (`_in_place_param_state`), where
    megatron gathers full-model buffers of every state on every rank and copies into and out of
    them (and, in megatron-core 0.16.1, slices them at the wrong positions when a buffer has more
    than one bucket: with PP > 1 the tied embedding's main weights were saved shifted by a row and
    resumed so, loss 9.6 -> 10.5). The checkpoint's keys, shapes, values and resharding across TP,
    PP and DP are megatron's. Not covered, and not built by the engine: precision-aware or
    CPU-offloading optimizers, several optimizer instances over one DP group."""
    from megatron.core.optimizer.distrib_optimizer import HybridDeviceOptimizer

    patched = []
    for opt in distributed_optimizers(optimizer):
        if opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 or isinstance(opt.optimizer, HybridDeviceOptimizer):
            raise NotImplementedError("checkpoints of a precision-aware or CPU-offloading distributed optimizer")
        if opt.ddp_config.num_distributed_optimizer_instances != 1:
            raise NotImplementedError("checkpoints of several distributed-optimizer instances over one DP group")
        opt.sharded_param_state_fully_reshardable = functools.partial(_in_place_param_state, opt)
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
    """dist_checkpointing's cached-metadata reader, reading a whole stored tensor straight into the
    tensor it is loaded into. torch.distributed.checkpoint's FileSystemReader torch.loads each stored
    tensor into new memory and then copies it into place; here only the item's header is read
    (`compat.torch.stored_tensor`: dtype, shape, strides, byte order and where the storage's bytes
    start), and when the item is one contiguous little-endian tensor of the target's dtype and shape
    that the target takes whole, its bytes are read into the target (a device target: into host
    memory reused from item to item, then copied). Anything else — transformed (compressed) items,
    partial reads (resharding), strided or other-dtype targets, tensor subclasses, big-endian files
    or hosts — goes through torch's own read_data."""
    import dataclasses

    import torch
    from megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader import (
        CachedMetadataFileSystemReader,
    )
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

    class DirectTensorReader(CachedMetadataFileSystemReader):
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
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy

    return torch_strategy._get_filesystem_reader(str(checkpoint_dir), cache_metadata=True).read_metadata()


def same_layout_strategy(device: Any, metadata: Any) -> Any:
    """megatron's torch_dist load strategy, skipping torch.distributed.checkpoint's planning where
    the checkpoint was saved in the layout it is loaded in: each tensor then reads its own stored
    chunk, through the same reader (`direct_tensor_reads`), and no shards are built, overlapped or
    exchanged between ranks. Where any rank's layout differs, every rank loads through megatron's
    path, which reshards. `device`: where the ranks' agreement is reduced (the process group's);
    `metadata`: the checkpoint's (`checkpoint_metadata`), read once for the whole load."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy
    from torch.distributed.checkpoint.planner import LoadPlan

    class SameLayoutLoadStrategy(torch_strategy.TorchDistLoadShardedStrategy):
        def load(self, sharded_state_dict: dict, checkpoint_dir: Any) -> dict:
            plan = _same_layout_plan(sharded_state_dict, metadata)
            if not _everyone(plan is not None, device):
                return super().load(sharded_state_dict, checkpoint_dir)
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

    return SameLayoutLoadStrategy()
