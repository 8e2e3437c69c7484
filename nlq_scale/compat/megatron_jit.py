"""megatron-core's `jit_fuser`, compiled on first call instead of at import.

megatron.core.jit sets `jit_fuser = torch.compile` when it is imported, and megatron's fusion modules
decorate their functions with it at import time, so `import megatron.core` imports dynamo and
inductor (~2.5 s a process on a CPU core) even in a run that never calls a fused function (a CPU
run: model/gpt.py turns the fusions off). torch.compile compiles on first call anyway;
`deferred_compile` only moves the torch.compile call itself there, so a run that calls a fused
function compiles it as before. Kept apart from compat/megatron.py because `import nlq_scale`
installs it: this module imports nothing heavy."""

from __future__ import annotations

import functools
import importlib.abc
import sys
from collections.abc import Callable
from typing import Any

from nlq_scale.compat import Private

DISTRIBUTION = "megatron-core"
WRITTEN_FOR = "==0.16.*"  # read against 0.16.1

JIT_MODULE = "megatron.core.jit"
RELIES_ON = (
    Private(JIT_MODULE, "jit_fuser"),
    Private(f"{JIT_MODULE}:enable_jit_fuser", "jit_fuser = torch.compile", in_source=True),
)


def deferred_compile(fn: Callable) -> Callable:
    """torch.compile(fn), made when the result is first called."""
    import torch  # imported already: megatron.core.jit imports it before decorating anything

    compiled = None

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal compiled
        if torch.compiler.is_compiling():  # inside a compiled caller: traced into, as dynamo does with a compiled fn
            return fn(*args, **kwargs)
        if compiled is None:
            compiled = torch.compile(fn)
        return compiled(*args, **kwargs)

    return call


class _DeferJitFuser(importlib.abc.MetaPathFinder):
    """Finds megatron.core.jit with the other finders, its loader wrapped in `_SwapAfterExec`."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != JIT_MODULE:
            return None
        sys.meta_path.remove(self)  # one module, once
        spec = next(filter(None, (f.find_spec(fullname, path, target) for f in sys.meta_path
                                  if hasattr(f, "find_spec"))), None)  # fmt: skip
        if spec is not None:
            spec.loader = _SwapAfterExec(spec.loader)
        return spec


class _SwapAfterExec(importlib.abc.Loader):
    """Runs megatron.core.jit, then swaps a `jit_fuser` that is torch.compile for `deferred_compile`,
    before any fusion module reads it."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        if module.jit_fuser is module.torch.compile:
            module.jit_fuser = deferred_compile

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename...: the wrapped loader's
        return getattr(self.loader, name)


def defer_jit_fuser() -> None:
    """Install the swap for this process, unless megatron.core.jit was imported already."""
    if JIT_MODULE not in sys.modules and not any(isinstance(f, _DeferJitFuser) for f in sys.meta_path):
        sys.meta_path.insert(0, _DeferJitFuser())
