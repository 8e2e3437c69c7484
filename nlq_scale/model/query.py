"""Building blocks of the arms' query paths, as megatron-core modules (tensor-parallel aware).

A query module maps the attention input x to this rank's slice of the query, [s, b, heads_per_rank *
head_dim]. Without sequence parallelism x is [s, b, d] on every tensor-parallel rank: norms run on
the full hidden vector on every rank and the last step scatters the full query to the local heads,
whose backward gathers the gradient so that replicated norm weights receive complete, identical
gradients on every rank. With it x is this rank's sequence shard [s/t, b, d]: the norms run on the
shard (their parameters marked `sequence_parallel`, so megatron sums their gradients over the
tensor-parallel group), the column-parallel W1 gathers the sequence and the row-parallel W2
reduce-scatters it back, and one all-to-all turns the query shard into the local heads of the
whole sequence.

Also the plain-torch MLP and norm epsilon that the reference model and the arms' reference queries
share (here rather than in model/reference.py, which imports the arms).
"""

from __future__ import annotations

from typing import Callable

import torch.nn.functional as F
import torch.utils.checkpoint
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    linear_with_grad_accumulation_and_async_allreduce,
)
from megatron.core.parallel_state import get_tensor_model_parallel_world_size
from megatron.core.tensor_parallel.mappings import (
    all_to_all_sp2hp,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
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


def compiled(fn: Callable[..., Tensor], enabled: bool) -> Callable[..., Tensor] | None:
    """fn compiled by torch.compile when enabled (parallel.compile_query), else None: inductor fuses
    its norms and elementwise work into generated kernels, forward and backward (the same function,
    other rounding). Off, the arms call their norm modules as before, so module hooks (the
    coordinate check, ZeRO-3's gathers) see them. Only pure tensor functions go through it:
    megatron's layers warn and communicate inside, which splits dynamo's graph into pieces. Every
    layer calls the same function, so one compilation per shape serves them all."""
    return torch.compile(fn) if enabled else None


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def mixed_layer_norm(x: Tensor, f: Tensor, weight: Tensor, bias: Tensor | None, eps: float, mix: float) -> Tensor:
    """mix * x + (1 - mix) * LayerNorm(f)."""
    return mix * x + (1.0 - mix) * F.layer_norm(f, (f.shape[-1],), weight, bias, eps)


def relu2(x: Tensor) -> Tensor:
    return F.relu(x).square()


ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu, "relu2": relu2, "silu": F.silu}
EPS = 1e-5  # the reference model's norm epsilon (its blocks' and the arms' reference queries')


class MLP(torch.nn.Module):
    """act(x W_up) W_down: the FFN, the nonlinear query's f before its LayerNorm, and preproj's MLP."""

    def __init__(self, d: int, width: int, bias: bool, activation: str = "gelu") -> None:
        super().__init__()
        self.up = torch.nn.Linear(d, width, bias=bias)
        self.down = torch.nn.Linear(width, d, bias=bias)
        self.act = ACTIVATIONS[activation]

    def forward(self, x: Tensor) -> Tensor:
        return self.down(self.act(self.up(x)))


def to_local_heads(q: Tensor, config: TransformerConfig) -> Tensor:
    """A full-width query ([s, b, d] on every rank, or this rank's sequence shard [s/t, b, d] under
    sequence parallelism) as this rank's heads over the whole sequence, [s, b, d/t]."""
    if not config.sequence_parallel:
        return scatter_to_tensor_model_parallel_region(q)
    t = get_tensor_model_parallel_world_size()
    shard, batch, width = q.shape
    return all_to_all_sp2hp(q).view(shard * t, batch, width // t)  # rank i holds positions i*s/t...


def on_sequence_shard(part: torch.nn.Module | torch.nn.Parameter, config: TransformerConfig):
    """Marks a module (or one parameter) acting on the full hidden vector of each token (norms,
    gains): under sequence parallelism each rank sees only its tokens, so megatron's
    finalize_model_grads must sum their gradients over the tensor-parallel group."""
    for param in [part] if isinstance(part, torch.nn.Parameter) else part.parameters():
        param.sequence_parallel = config.sequence_parallel
    return part


class ScatterToHeads(MegatronModule):
    """The query is the layer input itself, split to this rank's heads."""

    def __init__(self, config: TransformerConfig, **_unused) -> None:
        super().__init__(config=config)

    def forward(self, x: Tensor) -> Tensor:
        return to_local_heads(x, self.config)


class ParallelMLP(MegatronModule):
    """down(act(up(x))) with up: d -> width column-parallel and down: width -> d row-parallel
    (all-reduced, so the output is the full vector on every rank; under sequence parallelism up
    gathers the sequence and down reduce-scatters it, so the output is x's shard)."""

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

    def from_hidden(self, h: Tensor) -> Tensor:
        """down(act(h)) for h = up(x), this rank's slice of the hidden layer."""
        out, _ = self.down(self.activation(h))
        return out

    def forward(self, x: Tensor) -> Tensor:
        h, _ = self.up(x)
        return self.from_hidden(h)


def normed_mlp(
    norm: torch.nn.RMSNorm, mlp: ParallelMLP, x: Tensor, fuse_up: bool, compiled_norm: Callable[..., Tensor] | None
) -> Tensor:
    """mlp(norm(x)), with the norm folded into the MLP's first GEMM when fuse_up, else run as
    compiled_norm(x, gain, eps) where there is one (`compiled(rms_norm, ...)`)."""
    if fuse_up:
        return mlp.from_hidden(normed_up(norm, mlp.up, x))
    return mlp(norm(x) if compiled_norm is None else compiled_norm(x, norm.weight, norm.eps))


def normed_up(norm: torch.nn.RMSNorm, up: ColumnParallelLinear, x: Tensor) -> Tensor:
    """up(norm(x)) with the norm folded into up's GEMM (model.nlq.fuse_up): with g the norm's gain,
    up(norm(x)) = (x (W diag g)^T) / rms(x) + b, so the normalized x is neither written nor kept for
    backward; W diag g is formed at every step from the unfused modules' own parameters (checkpoints,
    export and muP classes do not change). The GEMM goes through megatron's column-parallel function
    (under sequence parallelism it gathers x's shards and keeps only the shard for backward);
    1/rms(x) is computed on the rank's tokens and gathered with them."""
    gain, sequence_parallel = norm.weight, up.sequence_parallel
    if not sequence_parallel:
        # One all-reduce over TP in backward for x's gradient (through the GEMM and through rms(x))
        # and for the gain's, of which this rank's W1 rows see only part. Under sequence parallelism
        # the GEMM reduce-scatters x's gradient and finalize_model_grads sums the gain's.
        x = copy_to_tensor_model_parallel_region(x, group=up.tp_group)
        gain = copy_to_tensor_model_parallel_region(gain, group=up.tp_group)
    h = linear_with_grad_accumulation_and_async_allreduce(
        input=x, weight=up.weight * gain, bias=None, gradient_accumulation_fusion=False,
        allreduce_dgrad=False, sequence_parallel=sequence_parallel, tp_group=up.tp_group,
    )
    inv_rms = _inv_rms(x, norm.eps)
    if sequence_parallel:
        inv_rms = gather_from_sequence_parallel_region(inv_rms, group=up.tp_group)
    h = h * inv_rms
    return h if up.bias is None else h + up.bias


def _inv_rms(x: Tensor, eps: float) -> Tensor:
    """1/sqrt(mean(x^2) + eps) per token, summed in float32 as torch's RMSNorm does for half types."""
    return torch.rsqrt(x.pow(2).mean(-1, keepdim=True, dtype=torch.float32) + eps).to(x.dtype)
