"""megatron-core's `jit_fuser`, compiled on first call instead of at import.

megatron.core.jit sets `jit_fuser = torch.compile` when it is imported, and megatron's fusion modules
decorate their functions with it at import time, so `import megatron.core` imports dynamo and
inductor (~2.5 s a process on a CPU core) even in a run that never calls a fused function (a CPU
run: model/gpt.py turns the fusions off). torch.compile compiles on first call anyway;
`deferred_compile` only moves the torch.compile call itself there, so a run that calls a fused
function compiles it as before. megatron-core 0.19's MoE router (imported by the pipeline
schedules) also decorates a method with torch.compile itself; it is deferred the same way. Kept apart from the other megatron compat modules because `import nlq_scale`
installs it: this module imports nothing heavy."""

from __future__ import annotations

import functools
import importlib.abc
import sys
from collections.abc import Callable
from typing import Any

from nlq_scale.compat import Private

DISTRIBUTION = "megatron-core"
WRITTEN_FOR = "==0.19.*"  # read against 0.19.2

JIT_MODULE = "megatron.core.jit"
# Compiles at class definition with torch.compile itself (InferenceTopKRouter's routing), and is
# imported by megatron's pipeline schedules, so by every training process.
ROUTER_MODULE = "megatron.core.transformer.moe.router"
RELIES_ON = (
    Private(JIT_MODULE, "jit_fuser"),
    Private(f"{JIT_MODULE}:enable_jit_fuser", "jit_fuser = torch.compile", in_source=True),
    Private(f"{ROUTER_MODULE}:InferenceTopKRouter", "_compiled_topk_routing"),
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


class _DeferCompiles(importlib.abc.MetaPathFinder):
    """Finds megatron.core.jit and the MoE router with the other finders, their loaders wrapped in
    `_DeferringLoader`; each module once."""

    def __init__(self) -> None:
        self.pending = {JIT_MODULE, ROUTER_MODULE} - set(sys.modules)

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in self.pending:
            return None
        self.pending.discard(fullname)
        if not self.pending:
            sys.meta_path.remove(self)
        spec = next(filter(None, (f.find_spec(fullname, path, target) for f in sys.meta_path
                                  if hasattr(f, "find_spec") and f is not self)), None)  # fmt: skip
        if spec is not None:
            spec.loader = _DeferringLoader(spec.loader)
        return spec


class _DeferringLoader(importlib.abc.Loader):
    """Runs the module with torch.compile standing for `deferred_compile` (what it decorates at
    import compiles at its first call), then swaps a `jit_fuser` that is torch.compile for
    `deferred_compile`, before any fusion module reads it."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        import torch

        compile_ = torch.compile
        torch.compile = deferred_compile  # for this module's body only: imports run one at a time
        try:
            self.loader.exec_module(module)
        finally:
            torch.compile = compile_
        if getattr(module, "jit_fuser", None) is compile_:
            module.jit_fuser = deferred_compile

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename...: the wrapped loader's
        return getattr(self.loader, name)


def defer_jit_fuser() -> None:
    """Install the deferral for this process, for the modules not imported already."""
    if not any(isinstance(f, _DeferCompiles) for f in sys.meta_path):
        finder = _DeferCompiles()
        if finder.pending:
            sys.meta_path.insert(0, finder)
