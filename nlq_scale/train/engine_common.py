"""What both engines share: the language-model loss (vocab-parallel cross entropy + optional z-loss)
and reducing per-micro-batch losses from the last pipeline stage to one global number."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
from torch import Tensor

from nlq_scale.runtime.device import Device


@dataclass(frozen=True)
class StepStats:
    loss: float
    grad_norm: float | None


def _vocab_parallel_logsumexp(logits: Tensor) -> Tensor:
    """logsumexp over the full vocabulary when logits are split across tensor-parallel ranks."""
    shift = logits.detach().max(dim=-1, keepdim=True).values
    dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    total = reduce_from_tensor_model_parallel_region(torch.exp(logits - shift).sum(dim=-1))
    return total.log() + shift.squeeze(-1)


def lm_loss(logits: Tensor, labels: Tensor, z_loss: float) -> Tensor:
    """Mean next-token cross entropy (+ z_loss * mean(logsumexp^2), PaLM's logit drift penalty)."""
    return lm_loss_and_sequences(logits, labels, z_loss)[0]


def lm_loss_and_sequences(logits: Tensor, labels: Tensor, z_loss: float) -> tuple[Tensor, Tensor]:
    """lm_loss, and each sequence's mean cross entropy (detached; what a validation loss's standard
    error is computed from)."""
    logits = logits.float()
    token_losses = vocab_parallel_cross_entropy(logits, labels)
    loss = token_losses.mean()
    if z_loss > 0:
        loss = loss + z_loss * _vocab_parallel_logsumexp(logits).square().mean()
    return loss, token_losses.detach().mean(dim=-1)


def eval_micro_batch(rows: int, micro_batch_size: int) -> int:
    """The largest micro-batch up to the training one that divides this rank's share of a validation
    set: any set size that the data-parallel ranks split evenly evaluates in equal micro-batches, in
    no more memory than training (evaluation keeps nothing for backward)."""
    return max(b for b in range(1, min(rows, micro_batch_size) + 1) if rows % b == 0)


@dataclass(frozen=True)
class EvalStats:
    loss: float
    stderr: float  # of the mean over the set's sequences: std of per-sequence losses / sqrt(sequences)


def reduce_eval(losses: list[dict], device: Device) -> EvalStats:
    """A validation set's loss (as reduce_last_stage_mean) and its standard error, from the
    per-sequence losses ('sequence losses') that the last pipeline stage's micro-batches hold."""
    contributes = bool(losses) and ps.get_tensor_model_parallel_rank() == 0
    x = torch.cat([d["sequence losses"].double().cpu() for d in losses]) if contributes else torch.zeros(0)
    sums = device.tensor([float(x.sum()), float(x.square().sum()), float(x.numel())], dtype=torch.float64)
    dist.all_reduce(sums)
    total, squares, n = (float(v) for v in sums)
    variance = max(squares - total * total / n, 0.0) / max(n - 1, 1)
    return EvalStats(reduce_last_stage_mean(losses, device), (variance / n) ** 0.5)


def reduce_last_stage_mean(losses: list[dict], device: Device) -> float:
    """Global mean of the 'lm loss' values that only the last pipeline stage holds, counted once
    per data-parallel rank (tensor-parallel peers hold copies)."""
    contributes = bool(losses) and ps.get_tensor_model_parallel_rank() == 0
    values = [float(d["lm loss"]) for d in losses] if contributes else []
    total = device.tensor([sum(values) / max(len(values), 1), float(contributes)], dtype=torch.float64)
    dist.all_reduce(total)
    return float(total[0] / total[1])
