"""A run's checkpoint as one single-process megatron GPT (TP = PP = 1, fp32, CPU), whatever engine
and layout saved it: the harness model that `generate` runs and `export` converts.

megatron engine: dist_checkpointing loads the model part into the TP=1 model's sharded state dict
(it reshards any TP/PP/DP layout). DeepSpeed engine: ZeRO stage 0 keeps whole per-TP-rank weights
in its model states, merged here by the partition dims the engine saved beside them; stages 1-3
go through DeepSpeed's universal-checkpoint conversion (the engine's own), written to a temporary
directory, never into the run directory. The converter merges the TP slices on the same recorded
partition dims, ZeRO-3's too (it reads a stage-3 checkpoint as a grid of TP x DP ranks).
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from nlq_scale.config.schema import ParallelConfig, RunConfig
from nlq_scale.errors import UsageError
from nlq_scale.train import untrusted
from nlq_scale.train.checkpoint import CheckpointDir
from nlq_scale.train.rundir import read_config


@dataclass(frozen=True)
class Checkpoint:
    run_dir: Path
    path: Path
    step: int
    cfg: RunConfig  # the run's config with a single-process fp32 layout


def find_checkpoint(run_dir: Path, step: int | None) -> Checkpoint:
    """The run's checkpoint at `step` (default: the newest complete one); UsageError naming what is wrong."""
    cfg = read_config(run_dir)
    ckpts = CheckpointDir(run_dir, keep=0)
    if step is None:
        path = ckpts.newest_complete(lambda _: None)
        if path is None:
            raise UsageError(f"{ckpts.root}: no complete checkpoint")
    else:
        if step < 0:
            raise UsageError(f"--step {step}: must be >= 0")
        path = ckpts.root / f"step_{step}"
        if not path.is_dir():
            have = sorted(int(p.name[5:]) for p in ckpts.root.glob("step_*") if p.name[5:].isdigit())
            raise UsageError(f"--step {step}: no checkpoint {path} (steps here: {have or 'none'})")
        problem = ckpts.problem(path)
        if problem is not None:
            raise UsageError(problem)
    cfg = cfg.model_copy(
        update={"parallel": ParallelConfig(), "model": cfg.model.model_copy(update={"bf16": False})}
    )
    return Checkpoint(run_dir=run_dir, path=path, step=int(path.name[5:]), cfg=cfg)


def load_harness_model(ckpt: Checkpoint) -> torch.nn.Module:
    """The megatron GPT of the checkpoint at TP = PP = 1 in this process, in eval mode. Call inside
    `nlq_scale.runtime.dist.distributed(ParallelConfig(), device="cpu")`."""
    from nlq_scale.model.gpt import build_gpt, seed_init
    from nlq_scale.train.engine_deepspeed import SHARDING_FILE

    seed_init(ckpt.cfg.seed)
    model = build_gpt(ckpt.cfg.model, ckpt.cfg.parallel, device=torch.device("cpu"))
    untrusted.check_metadata(ckpt.path)
    deepspeed = (ckpt.path / SHARDING_FILE).is_file()
    if deepspeed:
        _import_deepspeed()  # before the loads: the allowlist names DeepSpeed's classes once imported
    with untrusted.weights_only_loads(ckpt.path):
        if deepspeed:
            _load_full(model, _deepspeed_weights(ckpt.path), ckpt.path)
        else:
            _load_megatron(model, ckpt.path)
    return model.eval()


def _import_deepspeed() -> None:
    from nlq_scale.compat import deepspeed as deepspeed_compat
    from nlq_scale.runtime import cpu_shim

    cpu_shim.apply_deepspeed()
    deepspeed_compat.import_pickled_classes()


def _load_megatron(model: torch.nn.Module, path: Path) -> None:
    from megatron.core import dist_checkpointing

    if not (path / "metadata.json").is_file():
        raise UsageError(f"{path}: neither a megatron (metadata.json) nor a deepspeed checkpoint")
    state = dist_checkpointing.load(model.sharded_state_dict(), str(path))
    own = model.state_dict()  # the load also returns the checkpoint's common (non-model) entries
    model.load_state_dict({k: v for k, v in state.items() if k in own})


def _load_full(model: torch.nn.Module, weights: dict[str, Tensor], path: Path) -> None:
    """Full (unsharded) weights under the model's own names; every parameter must be there."""
    own = model.state_dict()
    missing = [k for k in own if k not in weights and not k.endswith("_extra_state")]
    if missing:
        raise UsageError(f"{path}: no weights for {missing[0]} ({len(missing)} missing)")
    for name, tensor in weights.items():
        if name in own and tuple(tensor.shape) != tuple(own[name].shape):
            raise UsageError(f"{path}: {name} has shape {tuple(tensor.shape)}, the model {tuple(own[name].shape)}")
    model.load_state_dict({k: v.float() for k, v in weights.items() if k in own}, strict=False)


def _deepspeed_weights(path: Path) -> dict[str, Tensor]:
    from nlq_scale.train.engine_deepspeed import TAG, read_sharding

    sharding = read_sharding(path)
    if sharding.zero_stage == 0:
        return _merge_model_states(path / TAG, sharding.tp)
    weights = _universal_weights(path / TAG)
    if sharding.zero_stage == 3 and sharding.tp == 1:
        weights = _unflatten_zero3(path / TAG, weights)
    return weights


def _unflatten_zero3(root: Path, weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """At tp=1 the converter leaves ZeRO-3 parameters flat; their shapes are in every rank's model
    states. (At tp > 1 it needs those shapes to merge the TP slices, so it returns them shaped.)"""
    states = untrusted.load(root / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    shapes = {k: v for group in states["param_shapes"] for k, v in group.items()}
    return {k: v.view(shapes[k]) if k in shapes else v for k, v in weights.items()}


def _merge_model_states(root: Path, tp: int) -> dict[str, Tensor]:
    """ZeRO-0: each TP rank's model states hold its whole slices; concatenate them on the partition
    dim the engine recorded (replicated parameters are taken from TP rank 0)."""
    from deepspeed.checkpoint import PARAMETER_WITH_ROW_PARALLELISM_PATTERNS, TP_REPLICATED_PARAMETER_PATTERNS

    states = [untrusted.load(root / f"mp_rank_{r:02d}_model_states.pt") for r in range(tp)]
    info = states[0]["universal_checkpoint_info"]
    replicated = [re.compile(p) for p in info[TP_REPLICATED_PARAMETER_PATTERNS]]
    row_parallel = [re.compile(p) for p in info[PARAMETER_WITH_ROW_PARALLELISM_PATTERNS]]
    merged = {}
    for name, tensor in states[0]["module"].items():
        if not isinstance(tensor, Tensor):
            continue
        if tp == 1 or any(p.match(name) for p in replicated):
            merged[name] = tensor
            continue
        dim = 1 if any(p.match(name) for p in row_parallel) else 0
        merged[name] = torch.cat([s["module"][name] for s in states], dim=dim)
    return merged


def _universal_weights(root: Path) -> dict[str, Tensor]:
    """ZeRO 1-3: DeepSpeed's universal checkpoint holds each parameter whole, in fp32."""
    from nlq_scale.train.engine_deepspeed import TAG, convert_to_universal

    with tempfile.TemporaryDirectory(prefix="nlq-export-") as tmp:
        universal = Path(tmp) / "universal"
        error = convert_to_universal(root, universal)
        if error is not None:
            _refuse_unloadable_file(root)
            raise UsageError(error.splitlines()[0])
        params = universal / TAG / "zero"
        return {p.name: _param(untrusted.load(p / "fp32.pt")) for p in sorted(params.iterdir()) if p.is_dir()}


def _refuse_unloadable_file(root: Path) -> None:
    """The converter's error does not say which file it failed on: the one `untrusted.load` refuses
    (raised with one line naming it), if any is."""
    for path in sorted(root.glob("*.pt")):
        untrusted.load(path)


def _param(saved: dict | Tensor) -> Tensor:
    """A universal fp32.pt holds {"param": tensor, ...}, or (parameters without optimizer state) the tensor."""
    from deepspeed.checkpoint.constants import PARAM

    return saved[PARAM] if isinstance(saved, dict) else saved
