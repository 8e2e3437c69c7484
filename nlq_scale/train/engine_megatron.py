"""The megatron engine: megatron-core DDP + (distributed) optimizer, the pipeline schedule from
get_forward_backward_func, and dist_checkpointing with a fully reshardable optimizer state."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor

from nlq_scale.compat import megatron_load, megatron_optimizer, megatron_save, megatron_shim
from nlq_scale.config.schema import RunConfig
from nlq_scale.errors import UsageError
from nlq_scale.model import mup
from nlq_scale.model.gpt import build_gpt, seed_init
from nlq_scale.runtime.device import Device
from nlq_scale.train.engine_common import (
    EvalStats,
    StepStats,
    eval_micro_batch,
    lm_loss_and_sequences,
    reduce_eval,
    reduce_last_stage_mean,
)
from nlq_scale.train.writers import WRITERS, writer_kind

# Reshardable across TP, PP and DP, so a run saved at one layout resumes at another.
_OPTIMIZER_FORMAT = {"distrib_optim_sharding_type": "fully_reshardable"}


def _mup_overrides(cfg: RunConfig, opt_config: OptimizerConfig) -> dict | None:
    """muP's per-group multipliers (nlq_scale.model.mup) for hidden matrices, added to megatron's own
    rule (no decay on 1-D params), which passing any overrides would otherwise drop. None under the
    standard parametrization: megatron's default groups, unchanged."""
    m = cfg.model
    if not mup.is_mup(m):
        return None
    from megatron.core.optimizer import ParamKey, ParamWithNamePredicate, get_standard_config_overrides

    hidden = ParamWithNamePredicate(
        name="mup_hidden", fn=lambda param, name: mup.param_class(m, name, param.dim()) == "hidden"
    )
    overrides = get_standard_config_overrides(opt_config)
    overrides[ParamKey(with_name_predicate=hidden)] = mup.group_multipliers(m, cfg.train)["hidden"]
    return overrides


def _no_padding_where_shapes_match(sharded: dict, stored: dict) -> None:
    """megatron zeroes every tensor the checkpoint may hold in another shape (the padded vocabulary's
    embedding and output layer, and their optimizer states) before reading it, so that rows the
    checkpoint lacks stay zero; where the stored shape is the same, the read overwrites all of it
    (at 124M, 0.46 GB zeroed for nothing). Those tensors then load as every other does, and a
    stored shape that differs keeps megatron's padding. `stored`: what the checkpoint stores by key
    (torch.distributed.checkpoint's metadata: a tensor's has its global size)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    for tensor in nested_values(sharded):
        if not (isinstance(tensor, ShardedTensor) and tensor.allow_shape_mismatch):
            continue
        size = getattr(stored.get(tensor.key), "size", None)  # None: not stored, or not a tensor
        if size is not None:
            tensor.allow_shape_mismatch = tuple(size) != tuple(tensor.global_shape)


def _training_schedule(schedule: Callable, config: TransformerConfig) -> Callable:
    """parallel.cuda_graph_impl=full_iteration: megatron's wrapper runs cuda_graph_warmup_steps training
    steps eagerly, captures the next one's whole forward-backward (the gradient reduction included) and
    replays it from then on; the optimizer step stays outside. Validation keeps the plain schedule: its
    number and size of micro-batches vary between sets, where one graph replays one of each."""
    if config.cuda_graph_impl != "full_iteration":
        return schedule
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper

    return FullCudaGraphWrapper(
        schedule,
        cuda_graph_warmup_steps=config.cuda_graph_warmup_steps,
        use_single_mempool=config.cuda_graph_use_single_mempool,
    )


@contextlib.contextmanager
def _gc_frozen() -> Iterator[None]:
    """megatron's optimizer runs a full gc.collect() whenever it builds its fully reshardable state
    (every save and load). Scanning the process's ~0.5 M long-lived objects (model, optimizer,
    imported modules) took 0.24 s of a 0.57 s load here; frozen for the call, the collection sees
    only what the call itself creates (load 0.34 s). Unfrozen afterwards, so nothing is kept alive."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class _BackgroundSave:
    """A save's write while training goes on, by a thread or a forked process (`train/writers.py`,
    checkpoint.async_writer); its finalization stays megatron's, and collective."""

    def __init__(self, request: AsyncRequest, staged: tuple | None, device: Device, writer: str) -> None:
        """`staged`: `staged_write`'s call and results queue, None where this rank writes nothing."""
        self._finalize, self._device = request.finalize_fns, device
        self._writer = None if staged is None else WRITERS[writer](*staged)

    def _writing(self) -> bool:
        return self._writer is not None and self._writer.is_alive()

    def written(self, blocking: bool) -> bool:
        """Collective: every rank's write ended, and the save then finalized (its metadata written;
        a failed write raises on every rank); with `blocking`, waits for that."""
        if blocking and self._writer is not None:
            self._writer.join()
        writing = self._device.put(torch.tensor([int(self._writing())]))
        dist.all_reduce(writing)
        if writing.item():
            return False
        for finalize in self._finalize:
            finalize()
        return True

    def abandon(self) -> None:
        """Not collective: wait for this rank's write alone, and leave the save unfinalized."""
        if self._writer is not None:
            self._writer.join()


class MegatronEngine:
    name = "megatron"

    def __init__(self, cfg: RunConfig, device: Device) -> None:
        self.cfg, self.device = cfg, device
        t = cfg.train
        if cfg.parallel.cuda_graph_impl != "none" and not device.is_cuda:
            raise UsageError(f"parallel.cuda_graph_impl={cfg.parallel.cuda_graph_impl}: needs a CUDA device "
                             f"(runtime.device={cfg.runtime.device} gave the CPU)")  # fmt: skip
        seed_init(cfg.seed, cuda_graphs=cfg.parallel.cuda_graph_impl != "none")
        model = build_gpt(
            cfg.model,
            cfg.parallel,
            pre_process=ps.is_pipeline_first_stage(),
            post_process=ps.is_pipeline_last_stage(),
            device=device.torch_device,
            deterministic=cfg.runtime.deterministic,
        )
        # Before DDP and the optimizer: megatron's torch norms and the arms' torch.nn modules are
        # created on the host even when megatron's own weights start on the GPU.
        model = model.to(device.torch_device)
        self.tconfig = model.config
        if cfg.model.bf16:
            model = Float16Module(self.tconfig, model)  # casts inputs/outputs around the bf16 model
        self.model = DistributedDataParallel(
            config=self.tconfig,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, use_distributed_optimizer=t.distributed_optimizer
            ),
            module=model,
        )
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=t.lr,
            min_lr=t.lr * t.min_lr_ratio,
            weight_decay=t.weight_decay,  # megatron skips 1-D params (norms, biases)
            adam_beta1=t.beta1,
            adam_beta2=t.beta2,
            adam_eps=t.eps,
            clip_grad=t.grad_clip,
            use_distributed_optimizer=t.distributed_optimizer,
            bf16=cfg.model.bf16,
            params_dtype=self.tconfig.params_dtype,
        )
        megatron_shim.device_grad_norm_fallback()
        self.optimizer = get_megatron_optimizer(opt_config, [self.model], config_overrides=_mup_overrides(cfg, opt_config))
        # Without these, data-parallel gradients are never reduced.
        self.tconfig.finalize_model_grads_func = finalize_model_grads
        self.tconfig.grad_scale_func = self.optimizer.scale_loss
        self.tconfig.no_sync_func = self.model.no_sync
        self._skip_step_when_loading_param_state()
        self._schedule = get_forward_backward_func()
        self._train_schedule = _training_schedule(self._schedule, self.tconfig)
        self._background: _BackgroundSave | None = None
        self._host_copies = megatron_save.HostCopies()
        self._positions = device.put(torch.arange(cfg.model.seq_length).unsqueeze(0))

    def set_lr(self, lr: float) -> None:
        """Also the weight decay: megatron marks 1-D params (norms, biases) with wd_mult = 0 and
        expects its own scheduler to apply the multipliers; without it they would be decayed."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
            group["weight_decay"] = self.cfg.train.weight_decay * group.get("wd_mult", 1.0)

    def _forward_step(self, data_iterator, model):
        tokens = next(data_iterator)["tokens"]
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        output = model(inputs, self._positions.expand(inputs.shape[0], -1), None)

        def loss_func(logits: Tensor):
            loss, sequences = lm_loss_and_sequences(logits, labels, self.cfg.train.z_loss)
            # The schedule divides the returned loss in place: report a detached copy.
            return loss, {"lm loss": loss.detach().clone(), "sequence losses": sequences}

        return output, loss_func

    def _run(self, tokens: Tensor, forward_only: bool, micro_batch_size: int | None = None) -> list[dict]:
        micro_batch_size = micro_batch_size or self.cfg.train.micro_batch_size
        # Dicts: the full-iteration graph copies each micro-batch's tensors into its static buffers by key.
        micro = [{"tokens": t} for t in tokens.split(micro_batch_size)]
        schedule = self._schedule if forward_only else self._train_schedule
        return schedule(
            forward_step_func=self._forward_step,
            data_iterator=iter(micro),
            model=[self.model],
            num_microbatches=len(micro),
            seq_length=self.cfg.model.seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=forward_only,
        )

    def train_step(self, tokens: Tensor) -> StepStats:
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        losses = self._run(tokens, forward_only=False)
        _, grad_norm, _ = self.optimizer.step()
        return StepStats(loss=reduce_last_stage_mean(losses, self.device), grad_norm=grad_norm)

    def evaluate(self, tokens: Tensor) -> EvalStats:
        self.model.eval()
        micro_batch_size = eval_micro_batch(tokens.shape[0], self.cfg.train.micro_batch_size)
        with self._without_autograd():
            losses = self._run(tokens, forward_only=True, micro_batch_size=micro_batch_size)
        return reduce_eval(losses, self.device)

    def _without_autograd(self) -> contextlib.AbstractContextManager:
        """Validation's mode. With local CUDA graphs, inference mode: a layer whose graphs are captured
        replays only training's micro-batch shape (validation's divides its set, so may be smaller),
        and megatron runs a layer eagerly under inference mode."""
        return torch.inference_mode() if self.tconfig.cuda_graph_impl == "local" else torch.no_grad()

    def _sharded_state(self, is_loading: bool) -> dict:
        model_state = self.model.module.sharded_state_dict()
        with _gc_frozen():
            optimizer_state = self.optimizer.sharded_state_dict(
                model_state, is_loading=is_loading, metadata=_OPTIMIZER_FORMAT
            )
        return {"model": model_state, "optimizer": optimizer_state}

    def save(self, ckpt_dir: Path, background: bool = False) -> None:
        """Collective. In the background, this call writes only the small common state and copies
        the tensors (`_BackgroundSave`); `save_written` tells when every rank's write ended."""
        # One at a time: the next background save copies into the memory this one's writer reads.
        assert self._background is None, "a background save is still being written"
        self._materialize_adam_state()  # a save before the first step would trip the same assert
        with megatron_optimizer.in_place_optimizer_state(self.optimizer):  # no full-model copies of the state
            state = self._sharded_state(is_loading=False)
        live = megatron_save.storages(state) if background else frozenset()  # before the save builds its factories
        with megatron_save.in_process_writes():
            request = dist_checkpointing.save(
                state, str(ckpt_dir), async_sharded_save=background, async_strategy=megatron_save.ASYNC_STRATEGY
            )
            if background:
                writer = writer_kind(self.cfg.checkpoint.async_writer, self.device.is_cuda)
                staged = megatron_save.staged_write(request, live, self._host_copies)  # the writer writes a snapshot
                self._background = _BackgroundSave(request, staged, self.device, writer)

    def save_written(self, blocking: bool) -> bool:
        """Collective: whether the background save has been written by every rank and finalized
        (dist_checkpointing's metadata written); a failed write raises here, on every rank."""
        if self._background is None:
            return True
        if not self._background.written(blocking):
            return False
        self._background = None
        return True

    def abandon_save(self) -> None:
        """Not collective (other ranks may be gone): wait for this rank's write, so none outlives
        the run writing into a directory a relaunch may reuse, and leave it unfinalized."""
        if self._background is not None:
            self._background.abandon()
            self._background = None

    def close(self) -> None:
        """Let the model, optimizer and the process groups they hold go with the engine's last
        reference. DDP's gradient-accumulator hooks live in autograd's C++ graph, where the garbage
        collector cannot see them, and reach the model's config, which __init__ wired to the
        optimizer: unless both links are cut, every engine built in a long-lived process (coord-check's
        widths, the tests) stays, with its process groups (gloo: a thread waking 100 times a second each)."""
        self.tconfig.grad_scale_func = self.tconfig.no_sync_func = self.tconfig.finalize_model_grads_func = None
        self.model.grad_accs.clear()
        self._release_cuda_graphs()

    def _release_cuda_graphs(self) -> None:
        """megatron keeps its graphs in process-wide state, which the next engine of this process would
        find (full_iteration refuses a second capture)."""
        if self.tconfig.cuda_graph_impl == "local":
            from megatron.core.transformer.cuda_graphs import delete_cuda_graphs

            delete_cuda_graphs()
        elif self.tconfig.cuda_graph_impl == "full_iteration":
            self._train_schedule.reset_cuda_graph()

    def _torch_adams(self) -> list[torch.optim.Optimizer]:
        """megatron-core's distributed optimizers on torch's Adam mishandle its `step` (0.16 to 0.19.2); the
        methods below (and compat.megatron_optimizer) mend it where the state is built and loaded."""
        return [o.optimizer for o in megatron_optimizer.torch_adam_distributed_optimizers(self.optimizer)]

    def _skip_step_when_loading_param_state(self) -> None:
        for opt in megatron_optimizer.torch_adam_distributed_optimizers(self.optimizer):
            megatron_optimizer.keep_adam_step_when_loading_param_state(opt)

    def _materialize_adam_state(self) -> None:
        """megatron-core's torch-Adam fallback (0.16.1, still 0.19.2) asserts on the `step` of a fresh optimizer when
        asked for its state dict (as loading does): create the state Adam would create lazily."""
        for adam in self._torch_adams():
            for group in adam.param_groups:
                for p in group["params"]:
                    if p not in adam.state:
                        adam.state[p] = {
                            "step": torch.tensor(0.0),
                            "exp_avg": torch.zeros_like(p),
                            "exp_avg_sq": torch.zeros_like(p),
                        }

    def _unshare_adam_steps(self) -> None:
        """...and after loading, every parameter's `step` is ONE shared tensor, which torch Adam
        increments in place once per parameter: give each parameter its own copy, or the bias
        correction is silently wrong after a resume."""
        for adam in self._torch_adams():
            for state in adam.state.values():
                state["step"] = state["step"].clone()

    def load(self, ckpt_dir: Path) -> None:
        self._materialize_adam_state()
        # Read into the optimizer's own tensors, each stored tensor straight into place rather than
        # torch.loaded and copied, without resharding plans where the layout is the checkpoint's
        # (compat.megatron_load; docs/performance.md).
        stored = megatron_load.checkpoint_metadata(ckpt_dir)
        same_layout = megatron_load.same_layout_strategy(self.device.torch_device, stored)
        with megatron_optimizer.in_place_optimizer_state(self.optimizer), megatron_load.direct_tensor_reads(stored):
            sharded = self._sharded_state(is_loading=True)
            _no_padding_where_shapes_match(sharded, stored.state_dict_metadata)
            state = dist_checkpointing.load(sharded, str(ckpt_dir), sharded_strategy=same_layout)
            self.model.module.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        self._unshare_adam_steps()
        dist.barrier()
