"""Norm variants megatron's stock specs do not offer: a LayerNorm without bias (model.norm_bias=false,
as nanoGPT's bias=False) and the parameter-free per-head RMS QK-norm (model.qk_norm=rms)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

HEAD_RMS_EPS = 1e-6


class HeadRMSNorm(nn.Module):
    """t / sqrt(mean(t^2 over the head dim) + 1e-6), no parameters. Built by megatron as a q/k
    layernorm (hidden_size, config, eps are given and unused: the eps is this norm's own)."""

    def __init__(self, *_unused, **_unused_kw) -> None:
        super().__init__()

    def forward(self, t: Tensor) -> Tensor:
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + HEAD_RMS_EPS)


class BlockNorm:
    """megatron's norm builder interface (config, hidden_size, eps) for torch norms with an optional
    LayerNorm bias (a ModuleSpec passes `bias`). Unlike megatron's own torch norm it allows sequence
    parallelism: its parameters are marked so that megatron sums their gradients over the
    tensor-parallel group (each rank normalises only its sequence shard)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, bias: bool = True, **_unused) -> nn.Module:
        from nlq_scale.model.query import on_sequence_shard

        if config.normalization == "RMSNorm":
            return on_sequence_shard(nn.RMSNorm(hidden_size, eps=eps), config)
        return on_sequence_shard(nn.LayerNorm(hidden_size, eps=eps, bias=bias), config)
