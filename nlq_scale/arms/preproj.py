"""preproj: x' = x + W_down act(W_up RMSNorm x) feeds the stock Q/K/V projections, and a content
skip W_skip x' (initialised near zero) joins the attention output."""

from __future__ import annotations

import math
from functools import cache

from pydantic import Field

from nlq_scale.arms.base import (
    MLPArm,
    QueryMLPOptions,
    export_recipe,
    linear_names,
    norm_names,
    query_width,
)
from nlq_scale.shape import linear_params, norm_params


class PreprojConfig(QueryMLPOptions):
    """model.preproj: the pre-projection MLP (W_up: d -> width, W_down: width -> d) and the content skip."""

    section = "preproj"
    skip_init_std: float = Field(1e-4, ge=0.0, description="W_skip starts near zero")


@cache
def _modules():
    """The megatron attention and the reference query path (torch is imported only when a model is built)."""
    from dataclasses import dataclass

    import torch
    from megatron.core.tensor_parallel import RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.utils import init_method_normal

    from nlq_scale.model.query import (
        ParallelMLP,
        compiled,
        normed_mlp,
        on_sequence_shard,
        recomputed,
        rms_norm,
        to_local_heads,
    )
    from nlq_scale.model.query import MLP

    @dataclass
    class PreprojSubmodules(SelfAttentionSubmodules):
        width: int = 0
        activation: str = "gelu"
        skip_init_std: float = 1e-4

    class PreprojAttention(SelfAttention):
        def __init__(self, config, submodules, layer_number, **kwargs):
            super().__init__(config=config, submodules=submodules, layer_number=layer_number, **kwargs)
            d, tp_group = config.hidden_size, self.pg_collection.tp
            norm = torch.nn.RMSNorm(d, eps=config.layernorm_epsilon, dtype=config.params_dtype)
            self.pre_norm = on_sequence_shard(norm, config)
            self.pre = ParallelMLP(config, submodules.width, submodules.activation, tp_group)
            self.compiled_norm = compiled(rms_norm, config.compile_query)
            # Its input is split over the hidden dim by to_local_heads (under sequence parallelism
            # from this rank's sequence shard), its output all-reduced (or reduce-scattered). A hidden
            # matrix with its own init std: muP's 1/sqrt(w) as megatron's config.init_method has it.
            skip_std = submodules.skip_init_std / math.sqrt(config.mup_width_mult)
            self.w_skip = RowParallelLinear(
                d, d, config=config, init_method=init_method_normal(skip_std),
                bias=config.add_bias_linear, input_is_parallel=True, skip_bias_add=False, is_expert=False,
                tp_group=tp_group,
            )

        def pre_mlp(self, x):
            return normed_mlp(self.pre_norm, self.pre, x, False, self.compiled_norm)

        def forward(self, hidden_states, *args, **kwargs):
            content = hidden_states + recomputed(self.pre_mlp, hidden_states, self.config.recompute_query)
            output, bias = super().forward(content, *args, **kwargs)
            skip, _ = self.w_skip(to_local_heads(content, self.config))
            return output + skip, bias

    class ReferencePreprojQuery(torch.nn.Module):
        def __init__(self, d, q_width, width, activation, bias, skip_init_std, eps):
            super().__init__()
            self.skip_init_std = skip_init_std
            self.pre_norm = torch.nn.RMSNorm(d, eps=eps)
            self.pre = MLP(d, width, bias, activation)
            self.linear_q = torch.nn.Linear(d, q_width, bias=bias)
            self.skip = torch.nn.Linear(d, d, bias=bias)

        def prepare(self, x):
            return x + self.pre(self.pre_norm(x))

        def forward(self, x):
            return self.linear_q(x)

        def finish(self, x, y):
            return y + self.skip(x)

        def init_arm_weights(self):
            torch.nn.init.normal_(self.skip.weight, 0.0, self.skip_init_std)

    return PreprojAttention, PreprojSubmodules, ReferencePreprojQuery


class Preproj(MLPArm):
    name = "preproj"
    summary = "x' = x + W_down act(W_up RMSNorm x) feeds Q/K/V; + W_skip x' after attention"
    options = PreprojConfig
    options_key = "preproj"
    fused_qkv = True
    sequence_parallel = True
    # Its MLP acts on the normalised input before Q/K/V; TE normalises inside linear_qkv.
    transformer_engine = False

    def query_params(self, m):
        d, r = m.hidden_size, self.width(m)
        return {
            "linear_q": linear_params(m, d, query_width(m)),
            "preproj_norm": norm_params(m, d, "RMSNorm"),
            "preproj_up": linear_params(m, d, r),
            "preproj_down": linear_params(m, r, d),
            "preproj_skip": linear_params(m, d, d),
        }

    def activation_elements(self, m, tokens):
        # RMSNorm output and the pre-projected x' (full vectors); W_up and activation outputs (split).
        return tokens * 2 * m.hidden_size, tokens * 2 * self.width(m)

    def recomputed_activation_elements(self, m, tokens):
        # x' stays (the input of Q/K/V and W_skip) beside x; the MLP's norm, W_up and activation outputs go.
        return tokens * m.hidden_size, 0.0

    def megatron_attention(self, m, stock, column_linear):
        attention, submodules, _ = _modules()
        o = self.settings(m)
        stock.module = attention
        stock.submodules = submodules(
            **vars(stock.submodules), width=self.width(m), activation=o.activation, skip_init_std=o.skip_init_std
        )
        return stock

    def reference_query(self, m):
        from nlq_scale.model.query import EPS

        o = self.settings(m)
        return _modules()[2](
            m.hidden_size, query_width(m), self.width(m), o.activation, m.add_bias_linear, o.skip_init_std, EPS
        )

    def export_query(self, m):
        o = self.settings(m)
        return export_recipe(q_proj=True, pre={"width": self.width(m), "activation": o.activation}, skip=True)

    def weight_names(self, m):
        a = "self_attention"
        return [
            *linear_names(m, "query.linear_q", f"{a}.linear_qkv", "attn.q_proj"),
            *norm_names(m, "query.pre_norm", f"{a}.pre_norm", "attn.pre.norm", "RMSNorm"),
            *linear_names(m, "query.pre.up", f"{a}.pre.up", "attn.pre.up"),
            *linear_names(m, "query.pre.down", f"{a}.pre.down", "attn.pre.down"),
            *linear_names(m, "query.skip", f"{a}.w_skip", "attn.skip"),
        ]


ARM = Preproj
