"""Checkpoints are data, never code.

Checkpoints and run directories live on shared cluster filesystems and come from other people, and
unpickling runs whatever a pickle names. So every pickle in a checkpoint is read with torch's
weights-only unpickler (tensors, containers, numbers, strings) plus an allowlist of the few classes a
format needs; torch.distributed.checkpoint's `.metadata`, which torch reads with plain pickle, is
first checked by an unpickler that resolves only its own dataclasses and enums. Anything else is
refused with one line before it can run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import importlib
import io
import pickle
import sys
from pathlib import Path
from typing import Any, Iterator

import torch

from nlq_scale.compat import deepspeed as deepspeed_compat
from nlq_scale.compat import torch as torch_compat
from nlq_scale.errors import RunFailure, UsageError, first_line
from nlq_scale.runtime.environ import environment

# The classes each format pickles besides tensors: numpy's RNG state (rng/rank_<r>.pt), DeepSpeed's
# ZeRO optimizer states. Named, not imported: DeepSpeed is only there when its engine runs.
ALLOWED = (
    "numpy._core.multiarray._reconstruct",  # numpy 2; numpy 1 pickles it as numpy.core.multiarray
    "numpy.core.multiarray._reconstruct",
    "numpy.ndarray",
    "numpy.dtype",
    "numpy.dtypes.UInt32DType",
    *deepspeed_compat.PICKLED_CLASSES,
)
# torch.distributed.checkpoint's metadata: its dataclasses and enums, torch sizes, dtypes and layouts.
_DCP_MODULES = ("torch.distributed.checkpoint.",)
_DCP_METADATA = ".metadata"


def _resolve(name: str) -> Any | None:
    """The allowlisted object, when its module is loaded here: DeepSpeed's matter only once its
    engine imported it, and only one of numpy's two spellings exists in a given numpy."""
    module, _, attr = name.rpartition(".")
    if module not in sys.modules and not module.startswith("numpy.dtypes"):
        return None
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        return None


def allowed_globals() -> list[Any]:
    return [obj for obj in map(_resolve, ALLOWED) if obj is not None]


def refusal(path: Path | str, err: BaseException) -> UsageError:
    """One line: the file, and what it tried to load."""
    detail = next((ln.strip() for ln in str(err).splitlines() if "GLOBAL" in ln or "global" in ln), None)
    return UsageError(f"{path}: refused: not plain checkpoint data ({(detail or first_line(err))[:200]})")


@contextlib.contextmanager
def _only_allowed() -> Iterator[None]:
    """The allowlist and nothing else: libraries widen torch's safe globals for the whole process
    (megatron-core adds SimpleNamespace, PosixPath, BytesIO, ...), so those are set aside meanwhile."""
    widened = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals(allowed_globals())
    try:
        yield
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(widened)


def load(path: Path) -> Any:
    """torch.load of a file from a checkpoint: tensors and the allowlisted classes, on the CPU."""
    try:
        with _only_allowed():
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise refusal(path, e) from None
    # What the weights-only unpickler and torch's zip reader raise on a file that is not a torch save
    # (a text file: IndexError from an empty stack; a cut zip: RuntimeError from the reader).
    except (EOFError, IndexError, KeyError, RuntimeError, TypeError, ValueError) as e:
        raise UsageError(f"{path}: not a readable torch file ({first_line(e)[:200]})") from None


class _Probe:
    """A class no allowlist names."""


@functools.cache
def _check_forcing() -> None:
    """TORCH_FORCE_WEIGHTS_ONLY_LOAD must override an explicit weights_only=False (as DeepSpeed
    passes): checked on this torch, once, with a class the weights-only unpickler must refuse."""
    buffer = io.BytesIO()
    torch.save(_Probe(), buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=False)
    except pickle.UnpicklingError:
        return
    raise RunFailure(f"torch {torch.__version__} ignores TORCH_FORCE_WEIGHTS_ONLY_LOAD: checkpoints cannot be loaded safely")


@contextlib.contextmanager
def weights_only_loads(where: Path) -> Iterator[None]:
    """Every torch.load inside, including the engines' own (DeepSpeed passes weights_only=False), is
    weights-only with the allowlist; a refusal becomes one line naming `where`."""
    try:
        with environment({"TORCH_FORCE_WEIGHTS_ONLY_LOAD": "1"}), _only_allowed():
            _check_forcing()
            yield
    except pickle.UnpicklingError as e:
        raise refusal(where, e) from None


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        # Only torch's own modules are imported to look: importing any other could run its code.
        named = (module, name) in torch_compat.DCP_METADATA_GLOBALS
        if named or module == "torch" or module.startswith(_DCP_MODULES):
            obj = getattr(importlib.import_module(module), name, None)
            if named or _dcp_type(module, obj) or _torch_constant(module, obj):
                return obj
        raise pickle.UnpicklingError(f"global '{module}.{name}' is not allowed")


def _dcp_type(module: str, obj: Any) -> bool:
    if not module.startswith(_DCP_MODULES) or not isinstance(obj, type):
        return False
    return dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)


def _torch_constant(module: str, obj: Any) -> bool:
    return module == "torch" and isinstance(obj, (torch.dtype, torch.layout, torch.memory_format))


def check_metadata(ckpt: Path) -> None:
    """torch.distributed.checkpoint unpickles `.metadata` with plain pickle: check it first."""
    for path in sorted(ckpt.rglob(_DCP_METADATA)):
        try:
            with path.open("rb") as f:
                _MetadataUnpickler(f).load()
        except (pickle.UnpicklingError, ImportError, EOFError, AttributeError, ValueError, TypeError) as e:
            raise refusal(path, e) from None

