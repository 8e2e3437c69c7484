"""Fault injection for tests. Production code carries no test hooks: a fault enters by replacing
the loss function the engines imported (`engine_common.lm_loss_and_sequences`) for as long as a test
says, or an engine's methods for the rest of the process."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
from collections.abc import Iterator
from unittest import mock

ENGINE_MODULES = ("nlq_scale.train.engine_megatron", "nlq_scale.train.engine_deepspeed")


def _nan_loss(real):
    @functools.wraps(real)
    def poisoned(*args, **kwargs):
        loss, sequences = real(*args, **kwargs)
        return loss * float("nan"), sequences * float("nan")

    return poisoned


@contextlib.contextmanager
def nan_loss() -> Iterator[None]:
    """Inside the block, every loss either engine computes is NaN (its gradients too)."""
    import importlib

    with contextlib.ExitStack() as stack:
        for name in ENGINE_MODULES:
            module = importlib.import_module(name)
            real = module.lm_loss_and_sequences
            stack.enter_context(mock.patch.object(module, "lm_loss_and_sequences", _nan_loss(real)))
        yield


def nan_loss_at_train_step(step: int) -> None:
    """From now on in this process, the `step`-th call (1-based) of either engine's `train_step`
    computes a NaN loss; evaluation and the other steps are untouched."""
    from nlq_scale.train.engine_deepspeed import DeepSpeedEngine
    from nlq_scale.train.engine_megatron import MegatronEngine

    calls = 0

    def wrap(train_step):
        @functools.wraps(train_step)
        def counted(self, tokens):
            nonlocal calls
            calls += 1
            with nan_loss() if calls == step else contextlib.nullcontext():
                return train_step(self, tokens)

        return counted

    for engine in (MegatronEngine, DeepSpeedEngine):
        engine.train_step = wrap(engine.train_step)


def crash_during_background_save(nth: int) -> None:
    """From now on in this process, the megatron engine's `nth` background checkpoint save ends the
    process group (SIGKILL, as a scheduler ends a job) at the first step that asks whether it is
    written: its writer started, nothing finalized."""
    from nlq_scale.train.engine_megatron import MegatronEngine

    save, save_written = MegatronEngine.save, MegatronEngine.save_written
    started = 0

    @functools.wraps(save)
    def counted_save(self, ckpt_dir, background=False):
        nonlocal started
        started += background
        return save(self, ckpt_dir, background)

    @functools.wraps(save_written)
    def crashing_save_written(self, blocking):
        if started == nth:
            os.killpg(0, signal.SIGKILL)
        return save_written(self, blocking)

    MegatronEngine.save, MegatronEngine.save_written = counted_save, crashing_save_written
