"""`runtime.check_device`: make device-placement mistakes fail on a CPU-only machine as they would on a GPU.

On a GPU node a tensor made without a device lands on the host, and the first op that mixes it with
device tensors raises; so does NCCL when a host tensor enters a collective. On the CPU both devices
are one, so such bugs pass silently. This mode splits them again, with the CPU as both:

- a *host* tensor is one made without an explicit device (factories, `torch.from_numpy`, the data
  loader's batches, `.cpu()`), or computed only from host tensors;
- everything else is a *device* tensor: made with `device=...` (megatron's `current_device()`
  buffers included), moved with `.to(device)` / `.cuda()`, or computed from a device tensor;
- an op that mixes a host tensor of one or more dimensions with a device tensor raises, as CUDA
  does (0-dim host tensors are allowed, as CUDA allows CPU scalars; copies and indexing are
  allowed, as CUDA allows them across devices); so does a host tensor entering a collective.

It is a TorchFunctionMode (Python-level, so it sees the harness's and the libraries' calls, not
autograd's C++ internals), plus wrappers around the torch.distributed collectives, active only inside
`checking_devices()`. It costs a few times the step time: for CI shapes, never for real runs.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor
from torch.overrides import TorchFunctionMode

from nlq_scale.compat.torch import WeakTensorKeyDictionary

# Factories: host unless given a device; *_like / new_* follow their input unless given one.
_FACTORIES = frozenset(
    getattr(torch, name)
    for name in (
        "empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn", "randint", "randperm",
        "as_tensor", "empty_strided", "linspace", "logspace", "eye", "scalar_tensor",
    )
)
_LIKE = frozenset(
    [getattr(torch, n) for n in ("empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like")]
    + [getattr(Tensor, n) for n in ("new_empty", "new_zeros", "new_ones", "new_full", "new_tensor")]
)
_TO_HOST = frozenset({Tensor.cpu, Tensor.numpy})
# Cross-device by design on CUDA too: copies, indexing with host indices, writes of host values.
_MIXING_ALLOWED = frozenset({Tensor.copy_, Tensor.__getitem__, Tensor.__setitem__, Tensor.index_put_, Tensor.to})

# Host tensors made outside the torch-function protocol (TorchFunctionMode never sees these calls).
_UNSEEN_HOST_CREATORS = ("from_numpy", "frombuffer")

COLLECTIVES = (
    "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
    "_all_gather_base", "_reduce_scatter_base", "reduce_scatter", "all_to_all_single", "all_to_all",
    "reduce", "gather", "scatter", "send", "recv", "batch_isend_irecv",
)
# isend/irecv stay unwrapped: P2POp accepts only the original functions (it checks their identity);
# their tensors are checked when the ops go through batch_isend_irecv, as megatron sends them.


class DevicePlacementError(RuntimeError):
    """A host tensor reached device compute or a collective."""


def _tensors(values: Any) -> Iterator[Tensor]:
    for value in values:
        if isinstance(value, Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, Tensor))


def _outputs(result: Any) -> Iterator[Tensor]:
    if isinstance(result, Tensor):
        yield result
    elif isinstance(result, (list, tuple)):
        yield from _tensors(result)


def _name(func: Callable) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))


def _describe(t: Tensor) -> str:
    return f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"


class HostTensors:
    """Which tensors are on the host. Weak keys: a freed tensor leaves no stale mark."""

    def __init__(self) -> None:
        self._host = WeakTensorKeyDictionary()

    def is_host(self, t: Tensor) -> bool:
        return t in self._host

    def mark(self, tensors: Iterator[Tensor], host: bool) -> None:
        for t in tensors:
            if host:
                self._host[t] = True
            else:
                self._host.pop(t, None)


def _moves_to_device(args: tuple, kwargs: dict) -> bool | None:
    """Tensor.to(...): True when a device is named, None when only the dtype changes."""
    if "device" in kwargs:
        return True
    for a in args[1:]:
        if isinstance(a, (torch.device, str, int)):
            return True
        if isinstance(a, Tensor):
            return True  # .to(other): other's device; the caller decides by other's placement
    return None


class _PlacementMode(TorchFunctionMode):
    def __init__(self, host: HostTensors) -> None:
        super().__init__()
        self.host = host

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func in _FACTORIES:
            self.host.mark(_outputs(result), host=kwargs.get("device") is None)
            return result
        inputs = list(_tensors(args)) + list(_tensors(kwargs.values()))
        if func in _LIKE:
            host = self.host.is_host(inputs[0]) if kwargs.get("device") is None else False
            self.host.mark(_outputs(result), host=host)
            return result
        if func in _TO_HOST:
            self.host.mark(_outputs(result), host=True)
            return result
        if func is Tensor.to:
            target = _moves_to_device(args, kwargs)
            other = next((a for a in args[1:] if isinstance(a, Tensor)), None)
            if target is not None:
                self.host.mark(_outputs(result), host=other is not None and self.host.is_host(other))
                return result
        if getattr(func, "__name__", "") == "__set__" and len(args) == 2 and isinstance(args[1], Tensor):
            # `param.data = moved`: how megatron moves tied weights; the parameter goes where `moved` is.
            self.host.mark(iter([args[0]]), host=self.host.is_host(args[1]))
            return result
        host_in = [t for t in inputs if self.host.is_host(t)]
        device_in = [t for t in inputs if not self.host.is_host(t)]
        wide_host = [t for t in host_in if t.dim() > 0]
        if wide_host and device_in and func not in _MIXING_ALLOWED:
            raise DevicePlacementError(
                f"device check: {_name(func)} mixes host tensor {_describe(wide_host[0])} with device tensor "
                f"{_describe(device_in[0])}: a host tensor reached device compute (move it with Device.put)"
            )
        if inputs and not device_in:
            self.host.mark(_outputs(result), host=True)
        return result


def _collective_tensors(args: tuple, kwargs: dict) -> Iterator[Tensor]:
    values = list(args) + list(kwargs.values())
    yield from _tensors(values)
    for value in values:  # batch_isend_irecv's list of P2POp
        if isinstance(value, list):
            yield from (op.tensor for op in value if isinstance(getattr(op, "tensor", None), Tensor))


def _checked_collective(name: str, original: Callable, host: HostTensors) -> Callable:
    def collective(*args: Any, **kwargs: Any):
        for t in _collective_tensors(args, kwargs):
            if host.is_host(t):
                raise DevicePlacementError(
                    f"device check: torch.distributed.{name} got host tensor {_describe(t)} (NCCL takes device tensors only)"
                )
        return original(*args, **kwargs)

    collective.__wrapped__ = original
    return collective


def _host_creator(original: Callable, host: HostTensors) -> Callable:
    def create(*args: Any, **kwargs: Any) -> Tensor:
        tensor = original(*args, **kwargs)
        host.mark(iter([tensor]), host=True)
        return tensor

    return create


def _checked_parameter_new(original: Callable, host: HostTensors) -> Callable:
    """nn.Parameter(data) is made in C++ (no torch function call): it inherits data's placement."""

    def new(cls, data=None, requires_grad=True):
        param = original(cls, data, requires_grad)
        if data is not None and host.is_host(data):
            host.mark(iter([param]), host=True)
        return param

    return new


@contextlib.contextmanager
def checking_devices() -> Iterator[HostTensors]:
    """Run the block with host/device placement checked (see the module docstring)."""
    host = HostTensors()
    stack = contextlib.ExitStack()
    saved = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
    creators = {name: getattr(torch, name) for name in _UNSEEN_HOST_CREATORS}
    parameter_new = vars(torch.nn.Parameter)["__new__"]
    try:
        # Library warnings raised inside the mode are attributed to it, past quiet_libraries' filters.
        stack.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", module=__name__)
        for name, original in saved.items():
            setattr(dist, name, _checked_collective(name, original, host))
        for name, original in creators.items():
            setattr(torch, name, _host_creator(original, host))
        torch.nn.Parameter.__new__ = staticmethod(_checked_parameter_new(torch.nn.Parameter.__new__, host))
        with _PlacementMode(host):
            yield host
    finally:
        for name, original in saved.items():
            setattr(dist, name, original)
        for name, original in creators.items():
            setattr(torch, name, original)
        torch.nn.Parameter.__new__ = parameter_new
        stack.close()
