"""mosaicml-streaming, imported without its text, vision and multimodal datasets; its internals: how
its shared-memory segments and lock files are named, the dataset's private threads and segments, and
the module globals patched so a rank builds its dataset without collectives. The project imports
streaming through here only (its dataset, writer and readers are re-exported)."""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import sys
import tempfile
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# What the packages' __init__s export (streaming's re-exports streaming.base's), and the module of
# streaming.base each comes from.
EXPORTED = {"CSVWriter": "format", "JSONWriter": "format", "LocalDataset": "local", "MDSWriter": "format",
            "Stream": "stream", "StreamingDataLoader": "dataloader", "StreamingDataset": "dataset",
            "TSVWriter": "format", "XSVWriter": "format"}  # fmt: skip


def _exported(package: str, name: str) -> Any:
    """The packages' module __getattr__ (PEP 562): an exported name imports its module on first use."""
    if name not in EXPORTED:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"streaming.base.{EXPORTED[name]}"), name)


def _bare_package(name: str) -> types.ModuleType:
    spec = importlib.util.find_spec(name)
    if spec is None:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    package = importlib.util.module_from_spec(spec)
    package.__getattr__ = functools.partial(_exported, name)
    sys.modules[name] = package
    return package


def _import_core_only() -> None:
    """Make `streaming` and `streaming.base` the packages without running their __init__s.
    streaming's imports the text, vision and multimodal datasets (transformers' tokenizers,
    scikit-learn, torchvision): 2.5-3.5 s of every rank's start on a CPU, and some 1,500 more modules
    per rank read from a cluster's shared file system. streaming.base's imports its data loader,
    which imports transformers for two type checks: ~1.7 s more, which no rank needs. What those
    __init__s export imports on first use; subpackages import on demand (`import streaming.text`).
    A process that imported streaming already keeps it."""
    if "streaming" in sys.modules:
        return
    package = _bare_package("streaming")
    try:
        package.base = _bare_package("streaming.base")
        package.__version__ = importlib.import_module("streaming._version").__version__
    except BaseException:
        for name in ("streaming", "streaming.base"):
            sys.modules.pop(name, None)
        raise


_import_core_only()

import streaming.base.dataset as _dataset  # noqa: E402 - after the import above
import streaming.base.shared.prefix as _prefix  # noqa: E402
from streaming.base import LocalDataset, MDSWriter, Stream, StreamingDataset  # noqa: E402,F401 - re-exported
from streaming.base.constant import BARRIER_FILELOCK, LOCALS, SHM_TO_CLEAN  # noqa: E402
from streaming.base.shared.memory import SharedMemory  # noqa: E402

from nlq_scale.compat import Private  # noqa: E402

DISTRIBUTION = "mosaicml-streaming"
WRITTEN_FOR = "==0.13.*"  # read against 0.13.0

SEGMENT_NAMES = frozenset(SHM_TO_CLEAN)  # every per-prefix segment a dataset may create
LOCALS_SEGMENT = LOCALS  # the segment that registers a prefix: while it exists the prefix is taken

_DATASET = "streaming.base.dataset:StreamingDataset"
RELIES_ON = (
    # _import_core_only: streaming's __init__ imports the subpackages and exports EXPORTED, nothing more...
    *(Private("streaming", f"import streaming.{name} as {name}", in_source=True)
      for name in ("multimodal", "text", "vision")),
    Private("streaming", "from streaming.base import (CSVWriter, JSONWriter, LocalDataset, MDSWriter, Stream,\n"
                         "                            StreamingDataLoader, StreamingDataset, TSVWriter, XSVWriter)\n",
            in_source=True),
    # ...and streaming.base's takes each exported name from its module in EXPORTED.
    *(Private("streaming.base", f"from streaming.base.{module} import", in_source=True)
      for module in sorted(set(EXPORTED.values()))),
    Private("streaming.base.shared.prefix", "_get_path", params=("prefix_int", "name")),
    Private("streaming.base.shared.prefix:_check_and_find", "gettempdir()", in_source=True),
    Private("streaming.base.shared.prefix", "dist"),
    Private("streaming.base.dataset", "dist"),
    Private("streaming.base.dataset", "maybe_init_dist", params=()),
    *(Private("streaming.base.constant", name) for name in ("BARRIER_FILELOCK", "LOCALS", "SHM_TO_CLEAN")),
    Private(f"{_DATASET}.__init__", "self._shm_prefix_int", in_source=True),
    *(Private(_DATASET, f"self.{name} =", in_source=True) for name in ("_iterator", "_executor", "_resume_shm")),
    Private("streaming.base.shared.memory:SharedMemory", "cleanup", params=()),
    Private("streaming.base.shared.memory:SharedMemory.__init__", "self.shm =", in_source=True),
    Private("streaming.base.hashing", "get_hash", params=("algo", "data")),
)

_NO_COLLECTIVES = types.SimpleNamespace(is_available=lambda: True, is_initialized=lambda: False)


def segment_name(prefix: int, name: str) -> str:
    """The /dev/shm name of segment `name` under `prefix` (also the lock-file name in the temp dir)."""
    return _prefix._get_path(prefix, name)


def prefix_of_segment(filename: str) -> int | None:
    """The prefix of a /dev/shm file streaming named with `segment_name`, or None for any other."""
    prefix, _, name = filename.partition("_")
    if prefix.isdigit() and name in SEGMENT_NAMES and segment_name(int(prefix), name) == filename:
        return int(prefix)
    return None


def prefix_lock_name(prefix: int) -> str:
    """A temp-dir file of this name makes streaming skip `prefix` when it picks a free one."""
    return _prefix._get_path(prefix, BARRIER_FILELOCK)


def shm_prefix(dataset: Any) -> int:
    return dataset._shm_prefix_int


def stop_threads(dataset: Any) -> None:
    iterator = getattr(dataset, "_iterator", None)
    if iterator is not None:
        iterator.exit()
    executor = getattr(dataset, "_executor", None)
    if executor is not None:
        executor.shutdown(wait=True)


def resume_segment(dataset: Any) -> SharedMemory | None:
    """The segment wrapper the last load_state_dict() made (None before the first)."""
    return getattr(dataset, "_resume_shm", None)


def shared_memory_wrappers(obj: Any, depth: int = 3) -> Iterator[SharedMemory]:
    """Streaming's SharedMemory wrappers reachable from the dataset (scalars, arrays, barrier)."""
    for value in list(vars(obj).values()):
        if isinstance(value, SharedMemory):
            yield value
        elif depth and type(value).__module__.startswith("streaming.base.shared"):
            yield from shared_memory_wrappers(value, depth - 1)


@contextlib.contextmanager
def _swapped(obj: Any, name: str, value: Any) -> Iterator[None]:
    saved = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, saved)


@contextlib.contextmanager
def standalone(lock_dir: Path) -> Iterator[None]:
    """While a StreamingDataset is built inside, streaming makes no torch.distributed call and reads
    and writes its lock files in `lock_dir` (it finds them through tempfile.gettempdir())."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(_swapped(tempfile, "tempdir", str(lock_dir)))
        stack.enter_context(_swapped(_dataset, "dist", _NO_COLLECTIVES))
        stack.enter_context(_swapped(_prefix, "dist", _NO_COLLECTIVES))
        stack.enter_context(_swapped(_dataset, "maybe_init_dist", lambda: False))
        yield


def xxh64(data: bytes) -> str:
    """The hash streaming's writer records for a shard."""
    from streaming.base.hashing import get_hash

    return get_hash("xxh64", data)
