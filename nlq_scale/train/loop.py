"""The one train loop. It composes an engine (megatron or DeepSpeed), the data feed, the LR schedule,
checkpoints, metrics, the divergence guard and preemption signals."""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from nlq_scale.config.schema import RunConfig
from nlq_scale.model.accounting import count_parameters, flops_per_token
from nlq_scale.runtime.device import Device
from nlq_scale.runtime.dist import World
from nlq_scale.runtime.kernels import report_missing
from nlq_scale.train.checkpoint import CheckpointDir, PendingSave
from nlq_scale.train.divergence import DivergenceGuard
from nlq_scale.train.feed import DataFeed
from nlq_scale.train.metrics import MetricsWriter
from nlq_scale.train.profiling import StepProfiler
from nlq_scale.train.rundir import Status, last_validation, manifest, write_manifest
from nlq_scale.train.schedule import lr_at
from nlq_scale.train.signals import StopFlag


def make_engine(cfg: RunConfig, device: Device):
    if cfg.train.engine == "deepspeed":
        from nlq_scale.train.engine_deepspeed import DeepSpeedEngine

        return DeepSpeedEngine(cfg, device)
    from nlq_scale.train.engine_megatron import MegatronEngine

    return MegatronEngine(cfg, device)


def accounting(cfg: RunConfig) -> dict:
    counts = count_parameters(cfg.model)
    return {
        "params": counts.total,
        "non_embedding_params": counts.non_embedding,
        "flops_per_token": flops_per_token(cfg.model),
    }


def _say(rank: int, message: str) -> None:
    if rank == 0:
        print(f"[nlq-scale] {message}", file=sys.stderr, flush=True)


def _broadcast_str(value: str | None) -> str | None:
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _any_rank(flag: bool, device: Device) -> bool:
    t = device.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


class Trainer:
    def __init__(self, cfg: RunConfig, run_dir: Path, world: World) -> None:
        self.cfg, self.run_dir, self.world = cfg, run_dir, world
        self.rank = world.rank
        self.tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_length
        self.flops_per_token = flops_per_token(cfg.model)
        self.status = Status(run_dir, cfg.train.steps, world.num_nodes)
        self.ckpts = CheckpointDir(run_dir, cfg.checkpoint.keep, cfg.checkpoint.keep_every)
        self.guard = DivergenceGuard(cfg.train.divergence)
        report_missing(self.rank)
        self.engine = make_engine(cfg, world.device)
        self.feed = DataFeed(cfg, world, run_dir)
        self.profiler = StepProfiler(cfg.logging.profile_steps, cfg.train.steps, run_dir, self.rank, world.device.is_cuda)
        self.step, self.tokens = 0, 0
        self._pending: PendingSave | None = None
        resumed_from = self._resume()
        # (step, val/loss) of the last validation, for the last line: a resumed run's from its metrics
        self.last_val = last_validation(run_dir) if resumed_from else None
        self.metrics = MetricsWriter(run_dir, cfg, resumed_from is not None, self.rank == 0, self.step)
        if self.rank == 0:
            from nlq_scale.data.loader import dataset_manifest_sha256

            layout_info = {
                "world_size": world.world_size,
                "nodes": world.num_nodes,
                "tp": world.tp,
                "pp": world.pp,
                "dp": world.dp,
                "ep": world.ep,
                "engine": cfg.train.engine,
                "zero_stage": self._zero_stage(),
            }
            write_manifest(run_dir, manifest(cfg, layout_info, dataset_manifest_sha256(cfg.data), accounting(cfg)))
            self._header(resumed_from is not None)
        event = {"event": "resume", "checkpoint": str(resumed_from)} if resumed_from else {"event": "start"}
        self.metrics.write({"step": self.step, "tokens": self.tokens} | event)

    def _zero_stage(self) -> int | None:
        return self.cfg.train.zero_stage if self.cfg.train.engine == "deepspeed" else None

    def _resume(self) -> Path | None:
        found = self.ckpts.newest_complete(lambda msg: _say(self.rank, msg)) if self.rank == 0 else None
        path = _broadcast_str(str(found) if found else None)
        if path is None:
            return None
        ckpt = Path(path)
        _say(self.rank, f"resuming from {ckpt}")
        self.ckpts.load_engine(ckpt, self.engine.load)
        state = self.ckpts.load_trainer_state(ckpt, self.rank, self.world.world_size)
        self.step, self.tokens = state["step"], state["tokens"]
        self.feed.load_state_dict(state["data"])
        self.guard.load_state_dict(state["guard"])
        return ckpt

    def _save(self, background: bool = False) -> None:
        """A checkpoint of the current step; in the background (checkpoint.async_save), committed by
        a later `_poll_save`. Any background save still in flight is committed first: one at a time."""
        self._poll_save(blocking=True)
        trainer_state = {
            "step": self.step,
            "tokens": self.tokens,
            "data": self.feed.state_dict(),
            "guard": self.guard.state_dict(),
            "world_size": self.world.world_size,
            "engine": self.cfg.train.engine,
        }
        if background:
            fill = functools.partial(self.engine.save, background=True)
            self._pending = self.ckpts.start(self.step, self.rank, fill, trainer_state)
        else:
            self._saved(self.ckpts.save(self.step, self.rank, self.engine.save, trainer_state))

    def _poll_save(self, blocking: bool) -> None:
        """Commit the background save once every rank has written it (collective; waits with `blocking`)."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None  # unless still in flight: a failed write ends it here
        if not self.ckpts.written(pending, self.rank, lambda: self.engine.save_written(blocking)):
            self._pending = pending
            return
        self._saved(self.ckpts.commit(pending, self.rank))

    def _saved(self, path: Path) -> None:
        # At the step it became complete, which is later than its own for a background save.
        if self.rank == 0:
            self.status.update(last_checkpoint=str(path), step=self.step, tokens=self.tokens)
        self.metrics.write({"step": self.step, "tokens": self.tokens, "event": "checkpoint", "checkpoint": path.name})

    def _finish(self, state: str, event: str, error: str | None = None, signal: str | None = None) -> str:
        self.profiler.stop()  # a run that ends inside the window keeps what it profiled
        self._poll_save(blocking=True)  # a diverged run's save in flight is of a step before the divergence
        record = {"step": self.step, "tokens": self.tokens, "event": event}
        if error:
            record["error"] = error
        if signal:
            record["signal"] = signal  # None on ranks the signal did not reach
        self.metrics.write(record)
        if self.rank == 0:
            self.status.update(state=state, step=self.step, tokens=self.tokens, error=error)
        self.metrics.close(state)
        _say(self.rank, f"{state} at step {self.step}: " + "; ".join(self._outcome(error)))
        return state

    def _outcome(self, error: str | None) -> list[str]:
        """What the last line says after the state: the error, the last validation loss, the run directory."""
        said = [error] if error else []
        if self.last_val is not None:
            step, loss = self.last_val
            said.append(f"val loss {loss:.4f}" + (f" (at step {step})" if step != self.step else ""))
        return [*said, f"run directory {self.run_dir}"]

    def _header(self, resumed: bool) -> None:
        """What a run trains, how and where, before its first step (rank 0)."""
        cfg, counts, world = self.cfg, count_parameters(self.cfg.model), self.world
        t = cfg.train
        _say(self.rank, f"{'resuming' if resumed else 'training'} {cfg.arm_label} at {cfg.scale or 'a custom scale'}: "
                        f"{counts.total:,} parameters ({counts.non_embedding:,} non-embedding), "
                        f"{self.tokens_per_step:,} tokens per step, {t.steps:,} steps")
        _say(self.rank, f"layout: {world.world_size} rank{'s' if world.world_size > 1 else ''} (tp {world.tp}, pp {world.pp}, dp {world.dp}), "
                        f"{t.engine} engine on {world.device.torch_device.type}; lr {t.lr:g} ({t.lr_schedule}, "
                        f"{t.warmup_steps} warmup steps)")
        _say(self.rank, f"run directory: {self.run_dir}")
        _say(self.rank, self.metrics.wandb.where(self.run_dir))

    def _train_record(self, lr: float, loss: float, grad_norm: float | None, seconds: float, digest: str) -> dict:
        tokens_per_s = self.tokens_per_step / seconds
        peak = self.cfg.train.device_peak_flops
        mfu = self.flops_per_token * tokens_per_s / (peak * self.world.world_size) if peak else None
        record = {
            "step": self.step,
            "tokens": self.tokens,
            "train/loss": loss,
            "lr": lr,
            "grad_norm": None if grad_norm is None else float(grad_norm),
            "tokens_per_s": tokens_per_s,
            "mfu": mfu,
            "data/hash": digest,
        }
        peak_memory = self.world.device.peak_memory_bytes()
        if peak_memory is not None:
            record["memory/peak_gb"] = peak_memory / 2**30
        return record

    def _validate(self) -> dict:
        """Every validation set's loss and its standard error over sequences (<metric>_stderr)."""
        record = {}
        for metric, tokens in self.feed.val.items():
            stats = self.engine.evaluate(tokens)
            record[metric], record[f"{metric}_stderr"] = stats.loss, stats.stderr
        return record

    def run(self) -> str:
        try:
            return self._run()
        except BaseException as error:
            if self.cfg.checkpoint.async_save:
                self.engine.abandon_save()  # uncommitted: the previous checkpoint stays the newest
            failure = self.ckpts.abandon(self._pending, self.rank, error) if self._pending else None
            if failure is not None:
                raise failure from error
            raise

    def _run(self) -> str:
        t = self.cfg.train
        if self.step >= t.steps:
            return self._finish("completed", "end")
        if self.rank == 0:
            self.status.update(state="running", error=None)
        with StopFlag() as stop:
            while self.step < t.steps:
                lr = lr_at(self.step, t)
                self.engine.set_lr(lr)
                batch = self.feed.next()
                digest = self.feed.digest(batch)
                self.profiler.before(self.step + 1)
                start = time.perf_counter()
                stats = self.engine.train_step(batch)
                seconds = time.perf_counter() - start
                self.step += 1
                self.profiler.after(self.step, seconds)
                self.tokens += self.tokens_per_step
                self._poll_save(blocking=False)
                record = self._train_record(lr, stats.loss, stats.grad_norm, seconds, digest)
                problem = self.guard.check_train(stats.loss)
                if self.step % t.log_every == 0 or self.step == t.steps:
                    self.metrics.progress(self.step, stats.loss, record["tokens_per_s"])
                if problem is None and (self.step % t.eval_every == 0 or self.step == t.steps):
                    val = self._validate()
                    record |= val
                    self.metrics.validation(self.step, val)
                    self.last_val = (self.step, val["val/loss"])
                    problem = self.guard.check_val(record["val/loss"])
                self.metrics.write(record)
                if problem is not None:
                    # No checkpoint: the last good one must not be replaced by a diverged state.
                    return self._finish("diverged", "diverged", problem)
                if _any_rank(stop.signum is not None, self.world.device):
                    self.profiler.stop()  # the window so far, without the save
                    self._save()
                    return self._finish("preempted", "preempt", signal=stop.signal_name)
                every = self.cfg.checkpoint.every
                if every and self.step % every == 0 and self.step < t.steps:
                    self._save(background=self.cfg.checkpoint.async_save)
                if self.rank == 0:
                    self.status.update(step=self.step, tokens=self.tokens)
        self._save()
        return self._finish("completed", "end")
