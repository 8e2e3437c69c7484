"""The registry of query arms. Adding an arm: one module in this package (see docs/arms.md) and
its name in `SHIPPED` (or a module anywhere, named in $NLQ_SCALE_ARMS). Everything else (config
choices and option sections, the megatron spec, the reference model, accounting, the planner,
analysis defaults) asks the registry.
"""

from __future__ import annotations

import os
from importlib import import_module
from importlib.util import module_from_spec, spec_from_file_location
from pathlib import Path
from types import ModuleType

from nlq_scale.arms.base import Arm, WeightName, validate_arm

_ARMS: dict[str, Arm] = {}


def register(arm: type[Arm]) -> type[Arm]:
    """Add an arm (usable as a class decorator). Call before the config schema is first imported:
    the schema's `model.arm` choices are fixed then."""
    validate_arm(arm)
    if arm.name in _ARMS:
        raise ValueError(f"arm {arm.name} is registered twice")
    _ARMS[arm.name] = arm()
    return arm


def get(name: str) -> Arm:
    try:
        return _ARMS[name]
    except KeyError:
        raise ValueError(f"unknown arm {name!r} (known: {', '.join(_ARMS)})") from None


def names() -> tuple[str, ...]:
    return tuple(_ARMS)


def all_arms() -> tuple[Arm, ...]:
    return tuple(_ARMS.values())


def baseline() -> Arm:
    """The arm others are compared against (exactly one declares `baseline = True`)."""
    (arm,) = [a for a in _ARMS.values() if a.baseline]
    return arm


def _load_plugin(ref: str) -> ModuleType:
    """An arm module outside the package: a dotted module name or a path to a .py file."""
    if not ref.endswith(".py"):
        return import_module(ref)
    path = Path(ref)
    spec = spec_from_file_location(f"nlq_scale_arm_{path.stem}", path)
    if spec is None or spec.loader is None or not path.is_file():
        raise ImportError(f"{PLUGINS_ENV}: no arm module at {ref}")
    module = module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The shipped arms, one module each in this package; a new arm adds its module's name here.
SHIPPED = ("linear", "identity", "nonlinear", "nonlinear_ph", "preproj", "residual")
# Arms kept outside the package, registered at import: comma-separated modules or .py files.
PLUGINS_ENV = "NLQ_SCALE_ARMS"

for _module in SHIPPED:
    register(import_module(f"nlq_scale.arms.{_module}").ARM)
for _ref in filter(None, os.environ.get(PLUGINS_ENV, "").split(",")):
    register(_load_plugin(_ref.strip()).ARM)

__all__ = ["Arm", "WeightName", "all_arms", "baseline", "get", "names", "register"]
