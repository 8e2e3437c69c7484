"""Query paths for the attention arms, as megatron-core modules (tensor-parallel aware).

Each module maps the attention input x [s, b, d] (replicated across tensor-parallel ranks) to this
rank's slice of the query, [s, b, heads_per_rank * head_dim]. Norms run on the full hidden vector
on every rank; the last step scatters the full query to the local heads, whose backward gathers
the gradient so that replicated norm weights receive complete, identical gradients on every rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import scatter_to_tensor_model_parallel_region
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor


def relu2(x: Tensor) -> Tensor:
    return F.relu(x).square()


ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu, "relu2": relu2, "silu": F.silu}


class IdentityQuery(MegatronModule):
    """W_Q = I: the query is the layer input itself (the attention scale carries the 1/2)."""

    def __init__(self, config: TransformerConfig, **_unused) -> None:
        super().__init__(config=config)

    def forward(self, x: Tensor) -> Tensor:
        return scatter_to_tensor_model_parallel_region(x)


class ParallelMLP(MegatronModule):
    """down(act(up(x))) with up: d -> r column-parallel and down: r -> d row-parallel (all-reduced,
    so the output is the full vector on every rank): the nonlinear query's f before its LayerNorm,
    and preproj's pre-projection."""

    def __init__(self, config: TransformerConfig, rank: int, activation: str, tp_group=None) -> None:
        super().__init__(config=config)
        d, bias = config.hidden_size, config.add_bias_linear
        self.activation = ACTIVATIONS[activation]
        self.up = ColumnParallelLinear(
            d, rank, config=config, init_method=config.init_method, bias=bias,
            gather_output=False, skip_bias_add=False, is_expert=False, tp_group=tp_group,
        )
        self.down = RowParallelLinear(
            rank, d, config=config, init_method=config.init_method, bias=bias,
            input_is_parallel=True, skip_bias_add=False, is_expert=False, tp_group=tp_group,
        )

    def forward(self, x: Tensor) -> Tensor:
        h, _ = self.up(x)
        out, _ = self.down(self.activation(h))
        return out


class NonlinearQuery(MegatronModule):
    """Q(x) = mix * x + (1 - mix) * LN(W2 act(W1 RMSNorm(x))), W1 = f.up, W2 = f.down."""

    def __init__(
        self, config: TransformerConfig, rank: int, activation: str, mix: float, tp_group=None, **_unused
    ) -> None:
        super().__init__(config=config)
        d, eps = config.hidden_size, config.layernorm_epsilon
        self.mix = mix
        self.norm_in = torch.nn.RMSNorm(d, eps=eps, dtype=config.params_dtype)
        self.f = ParallelMLP(config, rank, activation, tp_group)
        self.norm_out = torch.nn.LayerNorm(d, eps=eps, dtype=config.params_dtype)

    def forward(self, x: Tensor) -> Tensor:
        q = self.mix * x + (1.0 - self.mix) * self.norm_out(self.f(self.norm_in(x)))
        return scatter_to_tensor_model_parallel_region(q)
