"""megatron-core internals the CPU shim and the numerics mends patch: the modules whose tensor
factories or type strings assume CUDA, the RNG tracker's CUDA state functions, the gradient norm's
host-synchronizing fallback, and the MoE aux-loss scale megatron keeps as class state
(runtime/cpu_shim.py and train/engine_megatron.py go through here)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from nlq_scale.compat import Private

DISTRIBUTION = "megatron-core"
WRITTEN_FOR = "==0.19.*"  # read against 0.19.2

_RANDOM = "megatron.core.tensor_parallel.random"
_MOE_UTILS = "megatron.core.transformer.moe.moe_utils"
_CLIP_GRADS = "megatron.core.optimizer.clip_grads"

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

RELIES_ON = (
    Private(_RANDOM, "_get_cuda_rng_state", params=("device",)),
    Private(_RANDOM, "_set_cuda_rng_state", params=("new_state",)),
    # device_grad_norm_fallback: the norm function the grad clipping calls, and the fallback it replaces.
    Private(_CLIP_GRADS, "l2_norm_impl"),
    Private(f"{_CLIP_GRADS}:get_grad_norm_fp32", "l2_norm_impl,", in_source=True),
    Private("megatron.core.utils", "local_multi_tensor_l2_norm",
            params=("chunk_size", "noop_flag", "tensor_lists", "per_tensor")),
    *(Private(module, "torch") for module in sorted(set(FACTORY_CALL_SITES) | TYPE_STRING_CALL_SITES)),
    Private(f"{_MOE_UTILS}:MoEAuxLossAutoScaler", "main_loss_backward_scale"),
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


def moe_aux_loss_scale() -> Any:
    """The aux-loss backward scale megatron's schedule keeps as class state (None before its first set)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    return MoEAuxLossAutoScaler.main_loss_backward_scale
