"""DeepSpeed internals: the CPU shim's patch point, the grad norm ZeRO-0 discards, the universal-
checkpoint converter's script entry, and the classes its optimizer states pickle
(runtime/cpu_shim.py, train/engine_deepspeed.py, train/untrusted.py go through here). Importing
this module does not import DeepSpeed."""

from __future__ import annotations

import importlib
from argparse import Namespace
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from nlq_scale.compat import Private

DISTRIBUTION = "deepspeed"
WRITTEN_FOR = "==0.19.*"  # read against 0.19.8

# Classes DeepSpeed's checkpoints pickle besides tensors (train/untrusted.py allowlists them by name).
PICKLED_CLASSES = (
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
)

_CONVERTER = "deepspeed.checkpoint.ds_to_universal"
_CONVERTER_ARGS = dict(num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=False)

RELIES_ON = (
    Private("deepspeed.comm.torch", "build_shm_op", params=()),
    Private("deepspeed.runtime.utils", "get_flattened_grad_norm", params=("parameters", "norm_type", "mpu")),
    Private(_CONVERTER, "main", params=("args",)),
    *(Private(_CONVERTER, f"args.{field}", in_source=True) for field in ("input_folder", "output_folder", *_CONVERTER_ARGS)),
    # export/checkpoint.py reads ZeRO-3 checkpoints saved at tp > 1 through it: the converter must
    # read their files as a grid of TP x DP ranks, not as DP ranks alone.
    Private(f"{_CONVERTER}:main", "_build_zero3_rank_grid", in_source=True),
    *(Private(name.rsplit(".", 1)[0], name.rsplit(".", 1)[1]) for name in PICKLED_CLASSES),
)


def _no_shm_op() -> None:
    return None


def skip_shm_all_reduce_op() -> None:
    """deepspeed.comm.torch.TorchBackend.__init__ (deepspeed.initialize -> init_distributed, which
    wraps the gloo group we already made) JIT-compiles the shared-memory all-reduce op (37-95 s)
    after probing every op with compiler runs. Only inference_all_reduce uses it, and that falls
    back to the process group's all_reduce without it."""
    # `import deepspeed.comm.torch as m` would bind the `torch` name deepspeed.comm re-exports.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = _no_shm_op


def import_pickled_classes() -> None:
    """Import the modules of PICKLED_CLASSES, so train/untrusted.py's allowlist finds them before a
    DeepSpeed checkpoint is read outside a DeepSpeed engine."""
    for name in PICKLED_CLASSES:
        importlib.import_module(name.rsplit(".", 1)[0])


def flattened_grad_norm(parameters: Iterable[Any], mpu: Any) -> float:
    """The grad norm as DeepSpeed's clip_grad_norm_ measures it (model-parallel aware)."""
    from deepspeed.runtime.utils import get_flattened_grad_norm

    return float(get_flattened_grad_norm(parameters, mpu=mpu))


def convert_to_universal(source: Path, dest: Path) -> None:
    """ds_to_universal's script entry, in this process with one worker each."""
    from deepspeed.checkpoint import ds_to_universal

    ds_to_universal.main(Namespace(input_folder=str(source), output_folder=str(dest), **_CONVERTER_ARGS))
