"""Optional fused kernels and GPU libraries, probed once (no import is attempted mid-run).

megatron turns on a fused path from a config flag and imports its CUDA extension only when the
first batch reaches it: an ImportError there ends a run after its setup. Probing the modules here
lets the config ask only for what is installed, and names what is missing in one line each.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from functools import cache


def _installed(*modules: str) -> bool:
    try:
        return all(importlib.util.find_spec(m) is not None for m in modules)
    except (ImportError, ValueError):  # a parent package that fails to import
        return False


@dataclass(frozen=True)
class Kernels:
    """What this node can run besides plain PyTorch."""

    cuda: bool
    fused_softmax: bool  # megatron's scaled (upper-triangular) masked softmax CUDA extensions
    grad_accum_fusion: bool  # fused_weight_gradient_mlp_cuda (Apex)
    apex: bool
    transformer_engine: bool
    flash_attn: bool

    def missing(self) -> list[str]:
        names = {
            "fused_softmax": "megatron fused softmax kernels (scaled_masked_softmax_cuda): torch softmax is used",
            "grad_accum_fusion": "gradient-accumulation fusion (Apex fused_weight_gradient_mlp_cuda): off",
            "apex": "Apex: torch norms and torch Adam are used",
            "transformer_engine": "Transformer Engine: the local (torch) layer spec is used",
        }  # flash-attn is reported, never missed: the core attention runs through torch's SDPA
        return [text for key, text in names.items() if not getattr(self, key)]

    def as_dict(self) -> dict[str, bool]:
        return dict(vars(self))


@cache
def probe() -> Kernels:
    import torch

    cuda = torch.cuda.is_available()
    return Kernels(
        cuda=cuda,
        fused_softmax=cuda and _installed("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda"),
        grad_accum_fusion=cuda and _installed("fused_weight_gradient_mlp_cuda"),
        apex=_installed("apex"),
        transformer_engine=_installed("transformer_engine"),
        flash_attn=_installed("flash_attn"),
    )


def report_missing(rank: int) -> None:
    """One line per missing optional kernel, on rank 0, once per process (GPU runs only: on the CPU
    none of them applies)."""
    kernels = probe()
    if rank != 0 or not kernels.cuda:
        return
    for line in kernels.missing():
        print(f"[nlq-scale] not installed: {line}", file=sys.stderr, flush=True)
