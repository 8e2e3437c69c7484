"""Building blocks of the arms' query paths, as megatron-core modules (tensor-parallel aware).

A query module maps the attention input x [s, b, d] (replicated across tensor-parallel ranks) to this
rank's slice of the query, [s, b, heads_per_rank * head_dim]. Norms run on the full hidden vector
on every rank; the last step scatters the full query to the local heads, whose backward gathers
the gradient so that replicated norm weights receive complete, identical gradients on every rank.
"""

from __future__ import annotations

from typing import Callable

import torch.nn.functional as F
import torch.utils.checkpoint
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import scatter_to_tensor_model_parallel_region
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor


def recomputed(fn: Callable[[Tensor], Tensor], x: Tensor, enabled: bool) -> Tensor:
    """fn(x); when enabled (parallel.recompute_query), keeping for backward only x and the output and
    recomputing the rest. Non-reentrant checkpointing: it runs on any device and nests inside
    megatron's full-layer recompute; the query paths draw no random numbers, so no RNG state is
    stashed. Under tensor parallelism the recomputation repeats W2's all-reduce on every rank alike."""
    if not enabled:
        return fn(x)
    return torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=False, preserve_rng_state=False)


def relu2(x: Tensor) -> Tensor:
    return F.relu(x).square()


ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu, "relu2": relu2, "silu": F.silu}


class ScatterToHeads(MegatronModule):
    """The query is the layer input itself, split to this rank's heads."""

    def __init__(self, config: TransformerConfig, **_unused) -> None:
        super().__init__(config=config)

    def forward(self, x: Tensor) -> Tensor:
        return scatter_to_tensor_model_parallel_region(x)


class ParallelMLP(MegatronModule):
    """down(act(up(x))) with up: d -> width column-parallel and down: width -> d row-parallel
    (all-reduced, so the output is the full vector on every rank)."""

    def __init__(self, config: TransformerConfig, width: int, activation: str, tp_group=None) -> None:
        super().__init__(config=config)
        d, bias = config.hidden_size, config.add_bias_linear
        self.activation = ACTIVATIONS[activation]
        self.up = ColumnParallelLinear(
            d, width, config=config, init_method=config.init_method, bias=bias,
            gather_output=False, skip_bias_add=False, is_expert=False, tp_group=tp_group,
        )
        self.down = RowParallelLinear(
            width, d, config=config, init_method=config.init_method, bias=bias,
            input_is_parallel=True, skip_bias_add=False, is_expert=False, tp_group=tp_group,
        )

    def forward(self, x: Tensor) -> Tensor:
        h, _ = self.up(x)
        out, _ = self.down(self.activation(h))
        return out
