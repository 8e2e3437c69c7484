"""Sweep files (configs/sweeps/*.yaml) and their expansion into runs.

A sweep is a grid: scales x arms x seeds x learning rates (per arm allowed, since a fair comparison
tunes each arm), on one shared token stream (data path or streams, data seed) for a horizon in fixed
tokens or tokens per non-embedding parameter. Every grid point becomes a `RunSpec` whose `run_id`
(`<scale>-<arm>-s<seed>-lr<lr>`) is stable, so a resubmitted or requeued job finds its own run
directory `<root>/<sweep>/<run_id>/` and resumes.

Layering of one run's config (later wins): scale <- arm (configs/) <- the sweep's shared settings
(data, engine, parallel preferences, W&B project) <- sweep `overrides` <- the arm's `overrides`
<- command-line `key=value` overrides <- the grid point (name, sweep, seed, lr, steps from the horizon).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Literal

from pydantic import Field, PositiveFloat, PositiveInt, ValidationError, field_validator, model_validator

from nlq_scale.config.load import (
    config_file,
    available,
    build_run_config,
    compose_raw,
    deep_merge,
    parse_overrides,
    read_yaml,
    validation_message,
)
from nlq_scale.config.schema import RunConfig, StreamConfig, Strict
from nlq_scale.errors import UsageError
from nlq_scale.model.accounting import count_parameters

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def sanitize(text: str) -> str:
    """A file-name-safe token: anything outside [A-Za-z0-9._-] becomes '-'."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-")


def lr_token(lr: float) -> str:
    """6e-4 -> '0.0006', 3e-5 -> '3e-05': short, exact to 6 significant digits."""
    return f"{lr:g}"


def run_id_for(scale: str, arm: str, seed: int, lr: float) -> str:
    return sanitize(f"{scale}-{arm}-s{seed}-lr{lr_token(lr)}")


def nest(mapping: dict[str, Any]) -> dict[str, Any]:
    """Overrides may use dotted keys (`train.warmup_steps: 10`) or nested mappings; both become nested."""
    out: dict[str, Any] = {}
    for key, value in mapping.items():
        value = nest(value) if isinstance(value, dict) else value
        *parents, leaf = str(key).split(".")
        node: dict[str, Any] = {}
        top = node
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
        out = deep_merge(out, top)
    return out


class ArmSpec(Strict):
    name: str = Field(description="an arm in configs/arms (e.g. linear, nonlinear, linear-mlp4.75)")
    lrs: list[PositiveFloat] | None = Field(None, min_length=1,
                                            description="this arm's learning-rate grid; default: the sweep's")
    overrides: dict[str, Any] = Field(default_factory=dict, description="config overrides for this arm's runs")


class DataSpec(Strict):
    path: str | None = Field(None, description="prepared dataset dir (nlq-scale prepare-data)")
    streams: list[StreamConfig] | None = Field(None, description="mixture of prepared datasets with proportions")
    seed: int = Field(0, description="data seed shared by every run of the sweep: identical token stream")

    @model_validator(mode="after")
    def _one_source(self) -> DataSpec:
        if (self.path is None) == (self.streams is None):
            raise ValueError("give exactly one of data.path or data.streams")
        return self


class Horizon(Strict):
    tokens: PositiveInt | None = Field(None, description="train every run for this many tokens")
    tokens_per_param: PositiveFloat | None = Field(
        None, description="tokens = this x non-embedding parameters (e.g. 20, Chinchilla)"
    )

    @model_validator(mode="after")
    def _one(self) -> Horizon:
        if (self.tokens is None) == (self.tokens_per_param is None):
            raise ValueError("give exactly one of horizon.tokens or horizon.tokens_per_param")
        return self

    def tokens_for(self, non_embedding_params: int) -> int:
        if self.tokens is not None:
            return self.tokens
        return math.ceil(self.tokens_per_param * non_embedding_params)


class ParallelPrefs(Strict):
    """Preferences for the planner; None = let the planner choose."""

    tp: PositiveInt | None = Field(None, description="tensor-parallel size; None = smallest that fits")
    pp: PositiveInt | None = Field(None, description="pipeline-parallel size; None = smallest that fits")
    nodes: PositiveInt | dict[str, PositiveInt] | None = Field(
        None, description="nodes per run, or per scale {scale: nodes}; None = fewest whole nodes for tp x pp"
    )
    recompute: Literal["none", "selective", "full"] | None = Field(None, description="activation recompute")
    recompute_query: bool | None = Field(None, description="recompute the query MLP in backward (parallel.recompute_query)")
    sequence_parallel: bool | None = Field(None, description="use it in layouts with tp > 1 where the config "
                                           "allows it; None = where a layout fits only with it")
    distributed_optimizer: bool | None = Field(None, description="megatron engine: shard optimizer state over DP")
    zero_stage: int | None = Field(None, ge=0, le=3, description="deepspeed engine: ZeRO stage")
    micro_batch_size: PositiveInt | None = Field(None, description="None = the planner's: the largest that fits (docs/slurm.md); a number pins it")

    def nodes_for(self, scale: str) -> int | None:
        if isinstance(self.nodes, dict):
            return self.nodes.get(scale)
        return self.nodes


class LrSearch(Strict):
    """How each arm's learning rate is found (docs/mup.md)."""

    strategy: Literal["grid", "proxy"] = Field(
        "grid", description="grid: every LR of the grid at every scale; proxy: the grid on a narrow muP proxy, "
        "then each scale at the fitted optimum"
    )
    width: PositiveInt | None = Field(None, description="proxy: the proxy's width (a multiple of the head dim)")

    @model_validator(mode="after")
    def _width(self) -> LrSearch:
        if self.strategy == "proxy" and self.width is None:
            raise ValueError("strategy proxy needs a width")
        return self


class EvalSpec(Strict):
    """Downstream evaluation of every run once it has trained (`nlq-scale eval`, docs/evaluation.md)."""

    tasks: list[str] = Field(min_length=1, description="lm-eval task names, e.g. [nlq_lastword, nlq_cloze]")
    limit: PositiveInt | None = Field(None, description="documents per task (None: all)")
    batch_size: PositiveInt = 8


class SweepConfig(Strict):
    name: str = Field(description="sweep name: the directory under the root and the W&B group")
    arms: list[ArmSpec] = Field(min_length=1)
    scales: list[str] = Field(min_length=1)
    seeds: list[int] = Field([1234], min_length=1)
    lrs: list[PositiveFloat] | None = Field(None, min_length=1, description="learning-rate grid; None = each scale's train.lr")
    lr_search: LrSearch = LrSearch()
    data: DataSpec
    horizon: Horizon | None = Field(None, description="None = each scale's train.steps")
    engine: Literal["megatron", "deepspeed"] | None = None
    parallel: ParallelPrefs = ParallelPrefs()
    wandb_project: str | None = None
    cluster: str | None = Field(None, description="cluster file (path, or a name in configs/clusters)")
    root: str | None = Field(None, description="default run root for submit (default ./runs)")
    overrides: dict[str, Any] = Field(default_factory=dict, description="config overrides for every run")
    eval: EvalSpec | None = Field(None, description="evaluate each run after training: local executor right "
                                  "after the run, SLURM as a job depending on the training job (afterok)")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError(f"{v!r} must be a plain name ([A-Za-z0-9._-], not starting with . or -)")
        return v

    @field_validator("arms", mode="before")
    @classmethod
    def _arm_shorthand(cls, v: Any) -> Any:
        # `arms: [linear, nonlinear]` is shorthand for `[{name: linear}, {name: nonlinear}]`.
        if isinstance(v, list):
            return [{"name": a} if isinstance(a, str) else a for a in v]
        return v


@dataclass(frozen=True)
class RunSpec:
    """One grid point of a sweep, with its fully resolved config (before the planner sets the layout)."""

    sweep: str
    run_id: str
    scale: str
    arm: str
    seed: int
    lr: float
    cfg: RunConfig

    def run_dir(self, root: Path) -> Path:
        return Path(root) / self.sweep / self.run_id


def load_sweep(path: str | Path) -> SweepConfig:
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"sweep file {path} not found (known: {', '.join(available('sweeps'))})")
    raw = read_yaml(path)
    try:
        sweep = SweepConfig.model_validate(raw)
    except ValidationError as e:
        raise UsageError(validation_message(e, str(path))) from None
    _check_names(sweep, path)
    return sweep


def _check_names(sweep: SweepConfig, path: Path) -> None:
    for i, arm in enumerate(sweep.arms):
        if arm.name not in available("arms"):
            raise UsageError(f"{path}: arms.{i}: unknown arm {arm.name!r} (known: {', '.join(available('arms'))})")
    for i, scale in enumerate(sweep.scales):
        if scale not in available("scales"):
            raise UsageError(
                f"{path}: scales.{i}: unknown scale {scale!r} (known: {', '.join(available('scales'))})"
            )
    names = [a.name for a in sweep.arms]
    if len(set(names)) != len(names):
        raise UsageError(f"{path}: arms: {names} lists an arm twice (give one entry with an lr grid instead)")


def _absolute(path: str) -> str:
    """Jobs run in another working directory: local data paths are made absolute at expansion."""
    return path if "://" in path else str(Path(path).expanduser().resolve())


def shared_settings(sweep: SweepConfig) -> dict[str, Any]:
    """The sweep-level keys that every run's config gets."""
    p = sweep.parallel
    out: dict[str, Any] = {"data": sweep.data.model_dump(exclude_none=True, mode="json"), "parallel": {}, "train": {}}
    for key in ("tp", "pp", "recompute", "recompute_query"):  # sequence parallelism: the planner decides per layout
        if getattr(p, key) is not None:
            out["parallel"][key] = getattr(p, key)
    for key in ("distributed_optimizer", "zero_stage", "micro_batch_size"):
        if getattr(p, key) is not None:
            out["train"][key] = getattr(p, key)
    if sweep.engine is not None:
        out["train"]["engine"] = sweep.engine
    if sweep.wandb_project is not None:
        out["logging"] = {"wandb_project": sweep.wandb_project}
    return out


def expand(sweep: SweepConfig, cli_overrides: Iterable[str] = ()) -> list[RunSpec]:
    """Every (scale, arm, seed, lr) point of the sweep, in a stable order, with unique run ids."""
    cli = parse_overrides(list(cli_overrides))
    shared = shared_settings(sweep)
    specs: list[RunSpec] = []
    for scale in sweep.scales:
        for arm in sweep.arms:
            in_sweep = deep_merge(nest(sweep.overrides), nest(arm.overrides))
            if sweep.horizon is not None and "steps" in in_sweep.get("train", {}):
                raise UsageError(f"sweep {sweep.name}: arm {arm.name}: give horizon or train.steps, not both")
            # train.steps on the command line wins over the horizon (smoke tests of a real sweep).
            horizon = None if "steps" in cli.get("train", {}) else sweep.horizon
            base = deep_merge(deep_merge(deep_merge(compose_raw(scale, arm.name), shared), in_sweep), cli)
            for seed in sweep.seeds:
                for lr in arm.lrs or sweep.lrs or [None]:
                    specs.append(_grid_point(sweep, scale, arm.name, seed, lr, base, horizon))
    _check_unique(specs)
    return specs


def _grid_point(
    sweep: SweepConfig, scale: str, arm: str, seed: int, lr: float | None, base: dict, horizon: Horizon | None
) -> RunSpec:
    raw = deep_merge(base, {"seed": seed, "sweep": sweep.name})
    data = raw.get("data", {})
    if data.get("path"):
        data["path"] = _absolute(data["path"])
    for stream in data.get("streams") or []:
        stream["path"] = _absolute(stream["path"])
    if lr is not None:
        raw = deep_merge(raw, {"train": {"lr": lr}})
    # The probe only prices the model and the batch: its steps are a placeholder past any warmup,
    # since the real steps are what the horizon is about to set.
    probe = _build(deep_merge(raw, {"train": {"steps": 2**40}}) if horizon is not None else raw, f"{scale}/{arm}")
    run_id = run_id_for(scale, arm, seed, probe.train.lr)
    raw["name"] = run_id
    if horizon is not None:
        raw = deep_merge(raw, {"train": {"steps": horizon_steps(horizon, probe)}})
    cfg = _build(raw, run_id)
    return RunSpec(sweep.name, run_id, scale, arm, seed, cfg.train.lr, cfg)


def horizon_steps(horizon: Horizon, cfg: RunConfig) -> int:
    """Optimizer steps for the horizon: tokens / (global batch x sequence length), rounded up."""
    tokens = horizon.tokens_for(count_parameters(cfg.model).non_embedding)
    return max(1, math.ceil(tokens / (cfg.train.global_batch_size * cfg.model.seq_length)))


def _build(raw: dict, where: str) -> RunConfig:
    return build_run_config(raw, f"sweep run {where}")


def _check_unique(specs: list[RunSpec]) -> None:
    seen: dict[str, RunSpec] = {}
    for spec in specs:
        if spec.run_id in seen:
            raise UsageError(f"run id {spec.run_id} occurs twice (lrs too close to tell apart, or a repeated seed)")
        seen[spec.run_id] = spec


def data_paths(cfg: RunConfig) -> list[str]:
    if cfg.data.streams:
        return [s.path for s in cfg.data.streams]
    return [cfg.data.path] if cfg.data.path else []


def check_prepared_data(specs: Iterable[RunSpec]) -> None:
    """Every local dataset a run reads must be prepared, for the run's sequence length, with enough
    validation sequences (the data part's structural checks, without importing streaming): fail
    before submitting anything. Remote (scheme://) datasets are left to the job."""
    from nlq_scale.data.prepared import open_prepared

    opened: dict[str, Any] = {}

    def checked(path: str, field: str, seq_length: int):
        if path not in opened:
            opened[path] = open_prepared(path, field=field)
        if opened[path].seq_len != seq_length:
            raise UsageError(f"{field} {path}: prepared with --seq-len {opened[path].seq_len}, but model.seq_length is {seq_length}")
        return opened[path]

    def check_val(field: str, held: int, wanted: int) -> None:
        if held < wanted:
            raise UsageError(f"{field}: the validation split holds {held} sequences, fewer than {wanted}")

    for spec in specs:
        cfg, where = spec.cfg, f"run {spec.run_id}: "
        paths = data_paths(cfg)
        if not paths:
            raise UsageError(f"{where}data.path: no dataset given")
        if any("://" in p for p in paths):
            continue
        fields = [f"data.streams.{i}.path" for i in range(len(paths))] if cfg.data.streams else ["data.path"]
        held = sum(checked(p, where + f, cfg.model.seq_length).sequences("val") for p, f in zip(paths, fields))
        check_val(f"{where}data.val_sequences", held, cfg.data.val_sequences)
        for i, v in enumerate(cfg.data.validation):
            if "://" not in v.path:
                ds = checked(v.path, f"{where}data.validation.{i}.path", cfg.model.seq_length)
                check_val(f"{where}data.validation.{i}.sequences", ds.sequences("val"), v.sequences)


def sweep_path(name_or_path: str) -> Path:
    """A sweep file by path, or by name among the sweeps (shipped or in the user's config dirs)."""
    return config_file("sweeps", name_or_path)
