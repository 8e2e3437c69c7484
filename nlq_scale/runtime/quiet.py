"""Keep library chatter out of the progress output: megatron, torch.distributed and friends warn
about optional fused kernels (Apex, TE) on every import, which says nothing on CPU."""

from __future__ import annotations

import logging
import os
import warnings

VERBOSE_ENV = "NLQ_SCALE_VERBOSE"  # set by `nlq-scale --verbose`; inherited by ranks and jobs

_NOISY_MODULES = r"(megatron|torch\.distributed|torch\.utils\.cpp_extension|deepspeed|streaming)(\..*)?"


_QUIET_ENV = {"TQDM_DISABLE": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error"}


def quiet_libraries() -> None:
    if os.environ.get(VERBOSE_ENV):
        return
    for category in (UserWarning, DeprecationWarning, FutureWarning):
        warnings.filterwarnings("ignore", category=category, module=_NOISY_MODULES)
    for name in ("torch.utils.cpp_extension", "megatron.core", "DeepSpeed"):
        logging.getLogger(name).setLevel(logging.ERROR)
    # megatron-core 0.19's checkpoint writer logs each write failure at ERROR, by its type alone
    # ("error: <class 'OSError'>"), before the save's own one-line error names the file and the cause.
    logging.getLogger("megatron.core.dist_checkpointing.strategies.filesystem_async").setLevel(logging.CRITICAL)
    # DeepSpeed sets its logger's level back when imported (after this): a filter stays
    logging.getLogger("DeepSpeed").addFilter(_errors_only)
    # What export, generate and eval drive reports through its environment, read when it is imported:
    # datasets' and lm-eval's progress bars (tqdm takes its defaults from TQDM_*; a bar of ours passes
    # `disable` itself) and transformers' notices (the tokenizer's length notice on every long prompt).
    for name, value in _QUIET_ENV.items():
        os.environ.setdefault(name, value)


def _errors_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR
