"""What a node offers for training: torch, CUDA, the driver, NCCL, bf16, the optional kernels."""

from __future__ import annotations

import platform
import subprocess
from typing import Any


def _driver_version() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.split("\n")[0].strip() or None


def node_report() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from nlq_scale import __version__
    from nlq_scale.runtime.device import cuda_report
    from nlq_scale.runtime.kernels import probe

    cuda = torch.cuda.is_available()
    nccl = None
    if cuda and dist.is_nccl_available():
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    return {
        "nlq_scale": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": cuda_report(),
        "cuda_available": cuda,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
        "driver": _driver_version(),
        "nccl": nccl,
        "bf16": bool(cuda and torch.cuda.is_bf16_supported()),
        "kernels": probe().as_dict(),
    }
