"""Keep library chatter out of the progress output: megatron, torch.distributed and friends warn
about optional fused kernels (Apex, TE) on every import, which says nothing on CPU."""

from __future__ import annotations

import logging
import os
import warnings

VERBOSE_ENV = "NLQ_SCALE_VERBOSE"  # set by `nlq-scale --verbose`; inherited by ranks and jobs

_NOISY_MODULES = r"(megatron|torch\.distributed|torch\.utils\.cpp_extension|deepspeed|streaming)(\..*)?"


def quiet_libraries() -> None:
    if os.environ.get(VERBOSE_ENV):
        return
    for category in (UserWarning, DeprecationWarning, FutureWarning):
        warnings.filterwarnings("ignore", category=category, module=_NOISY_MODULES)
    for name in ("torch.utils.cpp_extension", "megatron.core", "DeepSpeed"):
        logging.getLogger(name).setLevel(logging.ERROR)
    # DeepSpeed sets its logger's level back when imported (after this): a filter stays
    logging.getLogger("DeepSpeed").addFilter(_errors_only)


def _errors_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR
