"""megatron-core's distributed optimizer, mended where its torch-Adam fallback and its fully
reshardable checkpoint state go wrong: the `step` a load drops, and the optimizer state saved from
and loaded into the optimizer's own tensors instead of full-model buffers (train/engine_megatron.py
goes through here)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

from nlq_scale.compat import Private

DISTRIBUTION = "megatron-core"
WRITTEN_FOR = "==0.19.*"  # read against 0.19.2

_DISTRIB = "megatron.core.optimizer.distrib_optimizer"
_BUFFER = "megatron.core.distributed.param_and_grad_buffer"

RELIES_ON = (
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
    Private(f"{_BUFFER}:_ParamAndGradBuffer.__init__", "self.param_index_map = param_layout.param_index_map", in_source=True),
    Private(f"{_DISTRIB}:DistributedOptimizer.sharded_param_state_fully_reshardable",
            "key=f'{prefix}.{state_key}.{sharded_metadata.key}'", in_source=True),
    Private(f"{_DISTRIB}:DistributedOptimizer.sharded_param_state_fully_reshardable",
            "prefix = 'optimizer.state'", in_source=True),
    Private(f"{_DISTRIB}:DistributedOptimizer.__init__", "self.gbuf_ranges", in_source=True),
    Private(f"{_DISTRIB}:DistributedOptimizer.__init__", "self.data_parallel_group = data_parallel_group", in_source=True),
    Private(f"{_DISTRIB}:DistributedOptimizer.__init__", "self.ddp_config = self.model_chunks[0].ddp_config", in_source=True),
    Private(f"{_DISTRIB}:DistributedOptimizer", "_get_main_param_and_optimizer_states", params=("model_param",)),
    Private(_DISTRIB, "HybridDeviceOptimizer"),
)


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
