"""CPU runtime shim for megatron-core 0.19 (and DeepSpeed's use of it): the only place where CUDA
assumptions are bent. `apply()` is a no-op when CUDA is available, so GPU code paths are untouched.

Every patch names the megatron call site that needs it. Patches are idempotent. The private
megatron and DeepSpeed names it patches are reached through nlq_scale/compat.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from typing import Any

import torch

from nlq_scale.compat import deepspeed as deepspeed_compat
from nlq_scale.compat import megatron_shim

# Tensor factories megatron calls with device='cuda' or pin_memory=True on CPU-only machines.
_FACTORIES = ("empty", "zeros", "ones", "full", "tensor", "arange", "empty_like", "zeros_like", "ones_like")


def needed() -> bool:
    return not torch.cuda.is_available()


def _cpu_rng_state(*_args: Any, **_kwargs: Any) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(state: torch.Tensor, *_args: Any, **_kwargs: Any) -> None:
    torch.set_rng_state(state)


def _cpu_manual_seed(seed: int, *_args: Any, **_kwargs: Any) -> None:
    torch.manual_seed(seed)


def _is_cuda_device(device: Any) -> bool:
    if device is None:
        return False
    if isinstance(device, int):
        return True  # a bare index means a CUDA ordinal in torch's factory API
    return torch.device(device).type == "cuda"


def _cpu_factory(fn):
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any):
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)

    return wrapper


class _CpuTorch:
    """Stands in for the `torch` name inside one megatron module: factories land on CPU,
    everything else is torch itself."""

    def __init__(self) -> None:
        for name in _FACTORIES:
            setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _tensor_cuda_to_self(self: torch.Tensor, *_args: Any, **_kwargs: Any) -> torch.Tensor:
    # Through .to(), so runtime.check_device sees the move to the device (a no-op on the CPU).
    return self.to(torch.cuda.current_device())


def _cuda_type_names(original):
    """Tensor.type() answers as if on CUDA, but only to megatron_shim.TYPE_STRING_CALL_SITES."""

    @functools.wraps(original)
    def type_(self: torch.Tensor, *args: Any, **kwargs: Any):
        result = original(self, *args, **kwargs)
        if args or kwargs or self.device.type != "cpu":
            return result
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller in megatron_shim.TYPE_STRING_CALL_SITES:
            return result.replace("torch.", "torch.cuda.", 1)
        return result

    return type_


class _HostStream:
    """The "current stream" of a CPU process: work runs in program order, so there is nothing to
    wait for."""

    def wait_event(self, event: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass


_HOST_STREAM = _HostStream()


def _patch_module_torch(module_name: str) -> None:
    module = importlib.import_module(module_name)
    if not isinstance(module.torch, _CpuTorch):
        module.torch = _CpuTorch()


def apply() -> None:
    """Patch torch.cuda and megatron-core so they run on CPU. Call before building any model."""
    if not needed() or getattr(torch.cuda, "_nlq_cpu_shim", False):
        return
    # megatron.core.tensor_parallel.layers / random: weights and RNG trackers ask for the device.
    torch.cuda.current_device = lambda: "cpu"
    # megatron.core.tensor_parallel.random.CudaRNGStatesTracker forks "CUDA" RNG states.
    for ns in (torch.cuda, torch.cuda.random):
        ns.get_rng_state = _cpu_rng_state
        ns.set_rng_state = _set_cpu_rng_state
        ns.manual_seed = _cpu_manual_seed
    # megatron.core timers, schedules and checkpointing call synchronize between phases.
    torch.cuda.synchronize = lambda *a, **k: None
    # megatron.core.distributed.param_and_grad_buffer (0.19): start_grad_sync orders the current
    # stream after CUDA-graph replays; the host runs in program order.
    torch.cuda.current_stream = lambda *a, **k: _HOST_STREAM
    # Tensor.cuda(): language_module.py (PP + tied embeddings), distrib_optimizer.py on save.
    torch.Tensor.cuda = _tensor_cuda_to_self
    torch.Tensor.type = _cuda_type_names(torch.Tensor.type)

    megatron_shim.replace_cuda_rng_state_functions(_cpu_rng_state, _set_cpu_rng_state)
    for name in megatron_shim.FACTORY_CALL_SITES:
        _patch_module_torch(name)
    torch.cuda._nlq_cpu_shim = True


def apply_deepspeed() -> None:
    """DeepSpeed on CPU. Call before `deepspeed.initialize`; a no-op with CUDA."""
    if not needed():
        return
    # deepspeed.accelerator.real_accelerator.get_accelerator (first call: `import deepspeed`) warns
    # on every rank when its auto-detection falls back to CPU: name the CPU accelerator instead.
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    deepspeed_compat.skip_shm_all_reduce_op()
