"""The compute device, decided once per process: `runtime.device` (auto | cuda | cpu) and the local
rank give `cuda:LOCAL_RANK` with NCCL, or the CPU with gloo. Every tensor the harness creates for
the model, the loss or a collective is created with, or moved by, `Device` — the one place that
knows where compute happens.

A run that asks for CUDA where there is none stops before any work (UsageError, exit 2), so a
driver mismatch on a GPU node can never train on the CPU by accident.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
from torch import Tensor

from nlq_scale.errors import UsageError


@dataclass(frozen=True)
class Device:
    """Where this process computes, and the collective backend that goes with it."""

    torch_device: torch.device

    @property
    def is_cuda(self) -> bool:
        return self.torch_device.type == "cuda"

    @property
    def backend(self) -> str:
        return "nccl" if self.is_cuda else "gloo"

    def put(self, tensor: Tensor) -> Tensor:
        """A host tensor (batch, positions, loaded state) onto the compute device. Always a new tensor,
        as a host-to-GPU move is: on the CPU the host original then stays a host tensor to
        runtime.check_device (a small batch-sized copy)."""
        return tensor.to(self.torch_device, non_blocking=self.is_cuda, copy=not self.is_cuda)

    def tensor(self, data: Any, dtype: torch.dtype | None = None) -> Tensor:
        """A new tensor on the compute device (loss reductions, flags, digests for collectives)."""
        return torch.tensor(data, dtype=dtype, device=self.torch_device)

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> Tensor:
        return torch.empty(tuple(shape), dtype=dtype, device=self.torch_device)

    def peak_memory_bytes(self) -> int | None:
        """Peak allocated device memory since the last reset (CUDA only; None on CPU)."""
        return torch.cuda.max_memory_allocated(self.torch_device) if self.is_cuda else None


@contextlib.contextmanager
def deterministic_kernels(device: Device, enabled: bool) -> Iterator[None]:
    """runtime.deterministic, for the block: on CUDA, kernels that sum in a fixed order, so a run
    resumed from a checkpoint can repeat the uninterrupted run bit for bit (atomics-based CUDA
    kernels, such as F.embedding's backward, sum in arrival order). The CPU kernels are
    deterministic already."""
    if not (enabled and device.is_cuda):
        yield
        return
    previous = torch.are_deterministic_algorithms_enabled()
    previous_fill = torch.utils.deterministic.fill_uninitialized_memory
    # cuBLAS repeats its sums only with a fixed workspace per stream; it reads this when a handle is
    # made, which is after this point (no matrix product has run yet).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    # Otherwise every new tensor is first filled with NaN: one more kernel per op output, a debugging
    # aid that torch documents as unneeded for determinism in a program that reads no uninitialized
    # memory (docs/performance.md counts them: a ninth of a training step's ops).
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)
        torch.utils.deterministic.fill_uninitialized_memory = previous_fill


def cuda_report() -> str:
    """What torch sees of CUDA, for the one-line error when CUDA was asked for and is missing."""
    built = torch.version.cuda or "none (a CPU-only torch build)"
    try:
        count = torch.cuda.device_count()
    except RuntimeError as e:  # a driver that torch cannot talk to
        count = f"unusable ({e})"
    return f"torch {torch.__version__} built with CUDA {built}, {count} CUDA device(s) visible"


def resolve_device(requested: str, local_rank: int) -> Device:
    """`runtime.device` for this process. auto = CUDA when torch can use it, else the CPU."""
    available = torch.cuda.is_available()
    if requested == "cuda" and not available:
        raise UsageError(f"runtime.device=cuda: CUDA is not available ({cuda_report()})")
    if requested == "cpu" or not available:
        return Device(torch.device("cpu"))
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise UsageError(
            f"runtime.device: local rank {local_rank} has no GPU ({count} visible; one process per GPU expected)"
        )
    return Device(torch.device("cuda", local_rank))
