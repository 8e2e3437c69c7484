"""Keep library chatter out of the progress output: megatron, torch.distributed and friends warn
about optional fused kernels (Apex, TE) on every import, which says nothing on CPU."""

from __future__ import annotations

import logging
import warnings

_NOISY_MODULES = r"(megatron|torch\.distributed|torch\.utils\.cpp_extension|deepspeed|streaming)(\..*)?"


def quiet_libraries() -> None:
    for category in (UserWarning, DeprecationWarning, FutureWarning):
        warnings.filterwarnings("ignore", category=category, module=_NOISY_MODULES)
    for name in ("torch.utils.cpp_extension", "megatron.core", "DeepSpeed"):
        logging.getLogger(name).setLevel(logging.ERROR)
