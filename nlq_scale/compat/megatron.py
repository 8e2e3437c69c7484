"""megatron-core internals: the CPU shim's patch points, the mends for the torch-Adam fallback
of the distributed optimizer, and the writer processes of background saves (runtime/cpu_shim.py,
train/engine_megatron.py, train/engine_deepspeed.py go through here)."""

from __future__ import annotations

import contextlib
import inspect
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
