"""The DeepSpeed engine: ZeRO stage 0-3 (`deepspeed.initialize`) around the same megatron-core GPT
and loss as the megatron engine, with DeepSpeed checkpoints that resume at another data- or
tensor-parallel size through universal-checkpoint conversion.

Inside a checkpoint dir this engine writes:
  deepspeed/           DeepSpeed's own files (tag "deepspeed": model states, ZeRO shards)
  deepspeed.json       the tag and the sharding it was saved at (`_Sharding`), read back by `load`
  universal.tmp/       only while loading at another sharding: source/ (the files as ds_to_universal
                       can read them) and deepspeed/ (its universal checkpoint); removed after
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import re
import shutil
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from torch import Tensor

from nlq_scale.compat import deepspeed as deepspeed_compat
from nlq_scale.compat import megatron_shim
from nlq_scale.config.schema import RunConfig
from nlq_scale.errors import UsageError
from nlq_scale.model import mup
from nlq_scale.model.gpt import build_gpt, seed_init
from nlq_scale.runtime import cpu_shim
from nlq_scale.runtime.device import Device
from nlq_scale.train.engine_common import (
    EvalStats,
    StepStats,
    eval_micro_batch,
    lm_loss_and_sequences,
    reduce_eval,
    reduce_last_stage_mean,
)
from nlq_scale.train.rundir import write_json

TAG = "deepspeed"
SHARDING_FILE = "deepspeed.json"
UNIVERSAL_DIR = "universal.tmp"


class MegatronMpu:
    """The model-parallel unit DeepSpeed asks for, answered by megatron's parallel_state. DeepSpeed's
    "model parallel" is tensor parallel here (the engine runs with PP=1 only)."""

    get_model_parallel_rank = staticmethod(ps.get_tensor_model_parallel_rank)
    get_model_parallel_world_size = staticmethod(ps.get_tensor_model_parallel_world_size)
    get_model_parallel_group = staticmethod(ps.get_tensor_model_parallel_group)
    get_tensor_model_parallel_rank = staticmethod(ps.get_tensor_model_parallel_rank)
    get_tensor_model_parallel_world_size = staticmethod(ps.get_tensor_model_parallel_world_size)
    get_tensor_model_parallel_group = staticmethod(ps.get_tensor_model_parallel_group)
    get_tensor_model_parallel_src_rank = staticmethod(ps.get_tensor_model_parallel_src_rank)
    get_data_parallel_rank = staticmethod(ps.get_data_parallel_rank)
    get_data_parallel_world_size = staticmethod(ps.get_data_parallel_world_size)
    get_data_parallel_group = staticmethod(ps.get_data_parallel_group)
    get_pipeline_model_parallel_rank = staticmethod(ps.get_pipeline_model_parallel_rank)
    get_pipeline_model_parallel_world_size = staticmethod(ps.get_pipeline_model_parallel_world_size)
    get_pipeline_model_parallel_group = staticmethod(ps.get_pipeline_model_parallel_group)

    @staticmethod
    def get_data_parallel_group_ranks() -> list[int]:
        return dist.get_process_group_ranks(ps.get_data_parallel_group())


@dataclass(frozen=True)
class _Sharding:
    """What decides whether DeepSpeed can load its own files as they are."""

    dp: int
    tp: int
    zero_stage: int
    bf16: bool

    @property
    def replicated_optimizer(self) -> bool:
        # ZeRO-0 saves the whole optimizer with the model states (written by DP rank 0, read by all).
        return self.zero_stage == 0

    def loads_plainly(self, saved: _Sharding) -> bool:
        return saved == self or (saved.replicated_optimizer and replace(saved, dp=self.dp) == self)


def ds_config(cfg: RunConfig, dp: int, load_universal: bool = False) -> dict:
    """DeepSpeed's config for this run at data-parallel size `dp`."""
    t = cfg.train
    return {
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.global_batch_size // (t.micro_batch_size * dp),
        "gradient_clipping": t.grad_clip,
        "zero_optimization": {"stage": t.zero_stage},
        "bf16": {"enabled": cfg.model.bf16},
        # bf16 grads accumulate over micro-batches in fp32, as megatron's grad buffers do. DeepSpeed
        # offers that with ZeRO >= 1 only; ZeRO-0 + bf16 accumulates in bf16.
        "data_types": {"grad_accum_dtype": "fp32" if t.zero_stage > 0 else None},
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": t.lr,
                "betas": [t.beta1, t.beta2],
                "eps": t.eps,
                "weight_decay": t.weight_decay,
                # torch.optim.AdamW on every device: DeepSpeed 0.19's FusedAdam is JIT-compiled with nvcc
                # at first use (absent on many compute nodes) and its cpu_adam only serves offload.
                "torch_adam": True,
            },
        },
        "checkpoint": {"load_universal": load_universal},
        "steps_per_print": 2**62,  # the loop reports progress; DeepSpeed's own lines are noise
        "wall_clock_breakdown": False,
    }


def _param_groups(model: torch.nn.Module, cfg: RunConfig) -> list[dict]:
    """Weight decay on matrices only, none on norms and biases (as megatron does); under muP the
    hidden matrices get their own group with its multipliers (nlq_scale.model.mup), which `set_lr`
    and the group's weight decay and eps apply."""
    m, wd = cfg.model, cfg.train.weight_decay
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not mup.is_mup(m):
        return [
            {"params": [p for _, p in params if p.dim() >= 2], "weight_decay": wd},
            {"params": [p for _, p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
    mult = mup.group_multipliers(m, cfg.train)
    by_class: dict[str, list] = {c: [] for c in mult}
    for n, p in params:
        by_class[mup.param_class(m, n, p.dim())].append(p)
    return [
        {"params": ps_, "weight_decay": wd * mult[c]["wd_mult"], "lr_mult": mult[c]["lr_mult"], "eps": mult[c]["eps"]}
        for c, ps_ in by_class.items()
        if ps_
    ]


def universal_checkpoint_info(model: torch.nn.Module) -> dict:
    """How ds_to_universal merges tensor-parallel slices: megatron tags each sharded parameter with
    its partition dim (0 = column-parallel, the converter's default; 1 = row-parallel); the rest are
    replicated across TP ranks."""
    from deepspeed.checkpoint import (
        PARAMETER_WITH_ROW_PARALLELISM_PATTERNS,
        TP_REPLICATED_PARAMETER_PATTERNS,
        UNIVERSAL_CHECKPOINT_VERSION_KEY,
    )

    replicated, row_parallel = [], []
    for name, param in model.named_parameters():
        pattern = re.escape(name) + "$"
        if not getattr(param, "tensor_model_parallel", False):
            replicated.append(pattern)
        elif param.partition_dim == 1:
            row_parallel.append(pattern)
    return {
        UNIVERSAL_CHECKPOINT_VERSION_KEY: 0.4,
        TP_REPLICATED_PARAMETER_PATTERNS: replicated,
        PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: row_parallel,
    }


class DeepSpeedEngine:
    name = "deepspeed"

    def __init__(self, cfg: RunConfig, device: Device) -> None:
        self.cfg, self.device = cfg, device
        self.sharding = _Sharding(
            dp=ps.get_data_parallel_world_size(),
            tp=ps.get_tensor_model_parallel_world_size(),
            zero_stage=cfg.train.zero_stage,
            bf16=cfg.model.bf16,
        )
        self._positions = device.put(torch.arange(cfg.model.seq_length).unsqueeze(0))
        self.engine = self._initialize(load_universal=False)

    def _initialize(self, load_universal: bool):
        cpu_shim.apply_deepspeed()
        import deepspeed

        seed_init(self.cfg.seed)
        # DeepSpeed moves the module to its accelerator's current device, which init_distributed set
        # to this Device; moving it here first keeps that explicit (and checked by check_device).
        cfg, device = self.cfg, self.device.torch_device
        model = build_gpt(cfg.model, cfg.parallel, device=device, deterministic=cfg.runtime.deterministic).to(device)
        # DeepSpeed saves this with the model states, where ds_to_universal looks for it.
        model.universal_checkpoint_info = universal_checkpoint_info(model)
        with _quiet():
            engine, *_ = deepspeed.initialize(
                model=model,
                model_parameters=_param_groups(model, self.cfg),
                config=ds_config(self.cfg, self.sharding.dp, load_universal),
                mpu=MegatronMpu(),
            )
        return engine

    def set_lr(self, lr: float) -> None:
        for group in self.engine.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)

    def _loss(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """The micro-batch's loss and its per-sequence losses (engine_common.lm_loss_and_sequences)."""
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        logits = self.engine(inputs, self._positions.expand(inputs.shape[0], -1), None)
        return lm_loss_and_sequences(logits, labels, self.cfg.train.z_loss)

    def _micro_batches(self, tokens: Tensor) -> list[Tensor]:
        micro = list(tokens.split(self.cfg.train.micro_batch_size))
        expected = self.engine.gradient_accumulation_steps()
        if len(micro) != expected or micro[-1].shape[0] != self.cfg.train.micro_batch_size:
            raise ValueError(
                f"rank batch of {tokens.shape[0]} sequences is not {expected} micro-batches of "
                f"{self.cfg.train.micro_batch_size}"
            )
        return micro

    def _own_grad_norm(self) -> float | None:
        """ZeRO-0 fp32 clips with DeepSpeed's clip_grad_norm_ and discards the norm; measure it the
        same way (the grads are already data-parallel reduced after the boundary backward)."""
        if self.engine.zero_optimization() or self.engine.bfloat16_enabled():
            return None
        return deepspeed_compat.flattened_grad_norm(self.engine.module.parameters(), self.engine.mpu)

    def train_step(self, tokens: Tensor) -> StepStats:
        self.engine.train()
        micro = self._micro_batches(tokens)
        if self.cfg.model.moe.num_experts is not None:
            # The router's aux loss enters in backward (MoEAuxLossAutoScaler), past DeepSpeed's 1/gas
            # loss scaling: scale it per micro-batch as megatron's schedule does.
            # The scale is class state shared with megatron's schedule in this process: keep its shape.
            current = megatron_shim.moe_aux_loss_scale()
            shape = current.shape if current is not None else (1,)
            MoEAuxLossAutoScaler.set_loss_scale(torch.full(shape, 1.0 / len(micro), device=self.device.torch_device))
        losses, own_norm = [], None
        for i, batch in enumerate(micro):
            loss, _ = self._loss(batch)
            self.engine.backward(loss)
            losses.append({"lm loss": loss.detach().clone()})
            if i == len(micro) - 1:
                own_norm = self._own_grad_norm()
            # DeepSpeed counts micro-batches and steps the optimizer only at the boundary.
            self.engine.step()
        grad_norm = own_norm if own_norm is not None else self.engine.get_global_grad_norm()
        return StepStats(loss=reduce_last_stage_mean(losses, self.device), grad_norm=_finite_or_nan(grad_norm))

    @torch.no_grad()
    def evaluate(self, tokens: Tensor) -> EvalStats:
        self.engine.eval()
        micro = tokens.split(eval_micro_batch(tokens.shape[0], self.cfg.train.micro_batch_size))
        losses = [dict(zip(("lm loss", "sequence losses"), self._loss(batch))) for batch in micro]
        return reduce_eval(losses, self.device)

    def close(self) -> None:
        """Let the model and its process groups go with the engine's last reference: DeepSpeed's
        gradient hooks keep the engine alive until destroy() removes them. A ZeRO-3 engine stays
        until the process ends all the same: DeepSpeed keeps it reachable (its model, for one, on
        a module-level stack of ZeRO-3's parameter-offload code)."""
        if self.engine is not None:
            self.engine.destroy()
            self.engine = None

    def save(self, ckpt_dir: Path) -> None:
        self.engine.save_checkpoint(str(ckpt_dir), tag=TAG, save_latest=False)
        if dist.get_rank() == 0:
            write_json(ckpt_dir / SHARDING_FILE, {"tag": TAG} | asdict(self.sharding))
        dist.barrier()

    def load(self, ckpt_dir: Path) -> None:
        saved = read_sharding(ckpt_dir)
        if self.sharding.loads_plainly(saved):
            self._load_from(ckpt_dir, strict=True)
            return
        if saved.replicated_optimizer:
            raise UsageError(
                f"{ckpt_dir / TAG}: saved with ZeRO stage 0 at tp={saved.tp} (no ZeRO shards to convert): "
                f"it resumes at ZeRO stage 0, tp={saved.tp}, bf16={saved.bf16} only"
            )
        universal = ckpt_dir / UNIVERSAL_DIR
        error = convert_to_universal(ckpt_dir / TAG, universal) if dist.get_rank() == 0 else None
        box = [error]
        dist.broadcast_object_list(box, src=0)
        if box[0] is not None:
            raise UsageError(box[0])
        # DeepSpeed reads load_universal from its config: re-create the engine with it.
        self.close()
        gc.collect()
        self.engine = self._initialize(load_universal=True)
        try:
            # Not strict: the converted model states lack megatron's None `_extra_state` entries;
            # every parameter comes from the universal fp32 files, which must all be there.
            self._load_from(universal, strict=False)
        finally:
            dist.barrier()
            if dist.get_rank() == 0:
                shutil.rmtree(universal, ignore_errors=True)

    def _load_from(self, root: Path, strict: bool) -> None:
        # The run config owns the per-group hyperparameters. DeepSpeed's ZeRO-3 universal load
        # copies group 0's onto every group (stage3.py, load_hp_checkpoint_state_from_checkpoint_dir_
        # stage3), which would put weight decay on norms and biases: put them back.
        groups = self.engine.optimizer.param_groups
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        path, _ = self.engine.load_checkpoint(
            str(root), tag=TAG, load_module_strict=strict, load_optimizer_states=True, load_lr_scheduler_states=False
        )
        if path is None:
            raise UsageError(f"{root / TAG}: DeepSpeed could not load this checkpoint")
        for group, values in zip(self.engine.optimizer.param_groups, hyper, strict=True):
            group.update(values)
        self._unshare_adam_steps()
        dist.barrier()

    def _unshare_adam_steps(self) -> None:
        """The same ZeRO-3 universal load gives every parameter group ONE `step` tensor, which
        torch's AdamW increments in place once per group: every group after the first would get
        a wrong bias correction. Give each its own copy."""
        base = getattr(self.engine.optimizer, "optimizer", self.engine.optimizer)
        for state in base.state.values():
            if isinstance(state.get("step"), Tensor):
                state["step"] = state["step"].clone()


def _finite_or_nan(grad_norm: float | Tensor | None) -> float | None:
    """DeepSpeed reports a non-finite gradient norm as -1."""
    if grad_norm is None:
        return None
    return float("nan") if float(grad_norm) < 0 else float(grad_norm)


def read_sharding(ckpt_dir: Path) -> _Sharding:
    path = ckpt_dir / SHARDING_FILE
    try:
        saved = json.loads(path.read_text())
        if saved.pop("tag") != TAG:
            raise ValueError(f"tag is not {TAG!r}")
        return _Sharding(**saved)
    except FileNotFoundError:
        raise UsageError(f"{path}: missing; {ckpt_dir} is not a deepspeed-engine checkpoint") from None
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        raise UsageError(f"{path}: unreadable deepspeed sharding ({type(e).__name__}: {e})") from None


def _tensor_model_states(source: Path, dest: Path) -> None:
    """`source` as seen by ds_to_universal, which calls .float() on every model-state entry:
    megatron's linear layers report a None `_extra_state` (Transformer Engine compatibility), so the
    model-state files are copied without those; the ZeRO shards are linked."""
    dest.mkdir(parents=True)
    for f in sorted(source.iterdir()):
        if not f.name.endswith("_model_states.pt"):
            (dest / f.name).symlink_to(f.resolve())
            continue
        state = torch.load(f, map_location="cpu", weights_only=True)  # in untrusted.weights_only_loads
        if state.get("module") is not None:
            state["module"] = {k: v for k, v in state["module"].items() if v is not None}
        torch.save(state, dest / f.name)


def convert_to_universal(source: Path, universal: Path) -> str | None:
    """ds_to_universal into universal/<TAG>, in this process (one worker: the ranks already use the
    cores). Returns an error message instead of raising, for the other ranks' sake."""
    shutil.rmtree(universal, ignore_errors=True)
    try:
        _tensor_model_states(source, universal / "source")
        with _quiet():
            deepspeed_compat.convert_to_universal(universal / "source", universal / TAG)
    except Exception as e:  # whatever the converter raises: report it on every rank
        shutil.rmtree(universal, ignore_errors=True)
        return f"{source}: universal-checkpoint conversion failed ({type(e).__name__}: {e})"
    return None


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DeepSpeed prints memory reports (BF16_Optimizer) and converter progress bars: show them only
    when something fails."""
    chatter = io.StringIO()
    try:
        with contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter):
            yield
    except BaseException:
        sys.stderr.write(chatter.getvalue()[-4000:])
        raise
