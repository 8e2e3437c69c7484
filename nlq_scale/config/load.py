"""YAML loading, layering (scale <- arm <- file <- overrides) and one-line validation errors."""

from __future__ import annotations

import copy
import difflib
import os
from importlib import resources
from pathlib import Path
from typing import Any, Iterable

import yaml
from pydantic import BaseModel, ValidationError

from nlq_scale.config.schema import RunConfig
from nlq_scale.errors import UsageError


def shipped_dir(what: str) -> Path:
    """A directory shipped inside the package ("configs": scales, arms, sweeps, clusters; "slurm":
    the sbatch templates), found the same way from a checkout, an editable install or a wheel."""
    return Path(str(resources.files("nlq_scale") / what))


CONFIG_DIR = shipped_dir("configs")
# Directories of the user's own scales/arms/sweeps/clusters, searched before the shipped ones
# (os.pathsep-separated; `nlq-scale --config-dir DIR` sets it for this process and its children).
CONFIG_PATH_ENV = "NLQ_SCALE_CONFIG_PATH"


def read_yaml(path: str | Path) -> dict[str, Any]:
    """A YAML mapping from a file, or a UsageError naming the file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise UsageError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise UsageError(f"{path}:{where} malformed YAML ({getattr(e, 'problem', None) or e})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _scalar(raw: str) -> Any:
    """A command-line value: numbers as numbers (PyYAML reads `1e-3` as a string), else YAML."""
    for number in (int, float):
        try:
            return number(raw)
        except ValueError:
            pass
    return yaml.safe_load(raw) if raw != "" else None


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """`a.b=1` strings into a nested dict; values are parsed as YAML scalars (1, 1e-3, true, [1,2])."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise UsageError(f"override {item!r}: expected key.path=value")
        try:
            value = _scalar(raw)
        except yaml.YAMLError:
            raise UsageError(f"override {item!r}: value is not valid YAML") from None
        node = out
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise UsageError(f"override {item!r}: {part} is set to a value and used as a section")
        node[leaf] = value
    return out


def config_roots() -> list[Path]:
    """Where named configs are looked up, first match wins: the user's directories, then the shipped."""
    user = [Path(p) for p in os.environ.get(CONFIG_PATH_ENV, "").split(os.pathsep) if p]
    return [*user, CONFIG_DIR]


def available(kind: str) -> list[str]:
    return sorted({p.stem for root in config_roots() for p in (root / kind).glob("*.yaml")})


def find_config(kind: str, name: str) -> Path | None:
    """<root>/<kind>/<name>.yaml in the first config root that has it."""
    return next((p for root in config_roots() if (p := root / kind / f"{name}.yaml").is_file()), None)


def config_file(kind: str, name_or_path: str) -> Path:
    """A file path as given, or a name looked up in the config roots (the first root's path when
    unknown, so the caller's "not found" names a real place)."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        return path
    return find_config(kind, name_or_path) or config_roots()[-1] / kind / f"{name_or_path}.yaml"


def named_config(kind: str, name: str) -> dict[str, Any]:
    """<kind>/<name>.yaml from the config roots, or a UsageError listing what exists."""
    path = find_config(kind, name)
    if path is None:
        singular = kind.rstrip("s")
        raise UsageError(f"unknown {singular} {name!r} (known: {', '.join(available(kind))})")
    return read_yaml(path)


def validation_message(err: ValidationError, source: str = "config", model: type[BaseModel] | None = None) -> str:
    """The first validation error as one line: `source: field.path: reason`; an unknown key of `model`
    (the validated one) names the near match, a typo's likely meaning."""
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"])
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        msg = "unknown key" + _near_key(model, [str(p) for p in first["loc"]])
    more = len(err.errors()) - 1
    suffix = f" (+{more} more)" if more else ""
    return f"{source}: {loc + ': ' if loc else ''}{msg}{suffix}"


def _near_key(model: type[BaseModel] | None, loc: list[str]) -> str:
    for part in loc[:-1]:  # down to the model that holds the unknown key
        field = model.model_fields.get(part) if model else None
        kind = field.annotation if field else None
        model = kind if isinstance(kind, type) and issubclass(kind, BaseModel) else None
    close = difflib.get_close_matches(loc[-1], list(model.model_fields), n=1) if model else []
    return f" (did you mean {'.'.join([*loc[:-1], close[0]])}?)" if close else ""


def build_run_config(raw: dict[str, Any], source: str = "config") -> RunConfig:
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as e:
        raise UsageError(validation_message(e, source, RunConfig)) from None


def compose_raw(
    scale: str | None = None,
    arm: str | None = None,
    config_path: str | Path | None = None,
    overrides: Iterable[str] = (),
) -> dict[str, Any]:
    """Layer scale <- arm <- config file <- command-line overrides into one raw mapping."""
    raw: dict[str, Any] = {}
    if scale is not None:
        raw = deep_merge(raw, named_config("scales", scale))
        raw["scale"] = scale
    if arm is not None:
        raw = deep_merge(raw, named_config("arms", arm))
        raw["variant"] = arm
    if config_path is not None:
        raw = deep_merge(raw, read_yaml(config_path))
    return deep_merge(raw, parse_overrides(overrides))


def load_run_config(
    scale: str | None = None,
    arm: str | None = None,
    config_path: str | Path | None = None,
    overrides: Iterable[str] = (),
) -> RunConfig:
    overrides = list(overrides)
    raw = compose_raw(scale, arm, config_path, overrides)
    source = str(config_path) if config_path else "config"
    return build_run_config(raw, source)


def dump_run_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
