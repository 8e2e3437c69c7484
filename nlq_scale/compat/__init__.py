"""Every private upstream API the project touches, one module per library (streaming, deepspeed,
submitit, torch, tiktoken) and for megatron-core one per concern (the CPU shim's patch points,
the distributed optimizer's state, checkpoint writes, checkpoint reads, and the jit_fuser in a
light module that `import nlq_scale` loads). Each
module states the versions it was written for (`WRITTEN_FOR`) and lists what it relies on
(`RELIES_ON`); tests/test_compat.py checks both against the installed library, so an upstream change
fails there, by name, instead of deep inside a run."""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass

MODULES = (
    "nlq_scale.compat.megatron_shim",
    "nlq_scale.compat.megatron_optimizer",
    "nlq_scale.compat.megatron_save",
    "nlq_scale.compat.megatron_load",
    "nlq_scale.compat.megatron_jit",
    "nlq_scale.compat.streaming",
    "nlq_scale.compat.deepspeed",
    "nlq_scale.compat.submitit",
    "nlq_scale.compat.torch",
    "nlq_scale.compat.tiktoken",
)


@dataclass(frozen=True)
class Private:
    """One upstream name the project relies on although upstream does not promise it.

    where: "module" or "module:Qualified.name"; name: the attribute looked up on it.
    params: for a callable, the leading parameter names it must still take (self excluded).
    in_source: `name` is text that the source of `where` must contain instead (an instance
    attribute its __init__ sets, a field its code reads)."""

    where: str
    name: str
    params: tuple[str, ...] | None = None
    in_source: bool = False

    def __str__(self) -> str:
        return f"{self.where}.{self.name}"

    def problem(self) -> str | None:
        """Why upstream no longer provides this, or None."""
        try:
            owner = _resolve(self.where)
        except (ImportError, AttributeError) as e:
            return f"{self.where}: gone ({e})"
        if self.in_source:
            return None if self.name in inspect.getsource(owner) else f"{self.where}: no longer uses {self.name}"
        if not hasattr(owner, self.name):
            return f"{self}: gone"
        if self.params is None:
            return None
        names = [p for p in inspect.signature(getattr(owner, self.name)).parameters if p not in ("self", "cls")]
        if tuple(names[: len(self.params)]) != self.params:
            return f"{self}: parameters are now {names}, written for {list(self.params)}"
        return None


def _resolve(where: str) -> object:
    module_name, _, qualname = where.partition(":")
    obj: object = importlib.import_module(module_name)
    for part in filter(None, qualname.split(".")):
        obj = getattr(obj, part)
    return obj


def version_problem(distribution: str, written_for: str) -> str | None:
    """None when the installed `distribution` is within `written_for` (a PEP 440 specifier)."""
    # imported here: `import nlq_scale` loads the megatron compat module (megatron_jit), and the
    # metadata and packaging imports are most of its cost
    from importlib.metadata import version

    from packaging.specifiers import SpecifierSet

    installed = version(distribution)
    if SpecifierSet(written_for).contains(installed, prereleases=True):
        return None
    return f"{distribution} {installed} is outside {written_for}, the range its compat module was written for"
