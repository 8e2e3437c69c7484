"""nonlinear: q = mix * x + (1 - mix) * LN(W2 act(W1 RMSNorm x)); the paper's (x + f(x))/2 at mix 1/2.

The authors' code writes q = x + LN(f(x)) with a halved attention scale; at mix = 1/2 and scale
1/sqrt(d_k) this is the same attention (tests/test_arms.py checks the logits on their module shapes).
"""

from __future__ import annotations

from functools import cache

from pydantic import Field

from nlq_scale.arms.base import (
    MLPArm,
    NormedQueryMLPOptions,
    export_recipe,
    linear_names,
    norm_names,
)
from nlq_scale.shape import norm_params


class NonlinearQueryConfig(NormedQueryMLPOptions):
    """model.nlq: f's width r (W1: d -> r, W2: r -> d), activation, fused RMSNorm, and the mix of x and f(x)."""

    section = "nlq"
    mix: float = Field(0.5, ge=0.0, le=1.0, description="weight of the X skip; f(X) gets 1 - mix")


@cache
def _modules():
    """The megatron and reference query modules (torch is imported only when a model is built)."""
    import torch
    from megatron.core.transformer.module import MegatronModule

    from nlq_scale.model.query import (
        ParallelMLP,
        compiled,
        mixed_layer_norm,
        normed_mlp,
        on_sequence_shard,
        rms_norm,
        to_local_heads,
    )
    from nlq_scale.model.query import MLP

    class NonlinearQuery(MegatronModule):
        """Norms on the full hidden vector of each token (every rank, or this rank's sequence
        shard), f's W1/W2 split over TP, then the query goes to this rank's heads."""

        def __init__(self, config, width, activation, mix, norm_bias, fuse_up, tp_group=None, **_unused):
            super().__init__(config=config)
            d, eps = config.hidden_size, config.layernorm_epsilon
            self.mix, self.fuse_up = mix, fuse_up
            self.norm_in = on_sequence_shard(torch.nn.RMSNorm(d, eps=eps, dtype=config.params_dtype), config)
            self.f = ParallelMLP(config, width, activation, tp_group)
            self.norm_out = on_sequence_shard(
                torch.nn.LayerNorm(d, eps=eps, bias=norm_bias, dtype=config.params_dtype), config
            )
            self.compiled_norm = compiled(rms_norm, config.compile_query)
            self.compiled_mix = compiled(mixed_layer_norm, config.compile_query)

        def forward(self, x):
            f = normed_mlp(self.norm_in, self.f, x, self.fuse_up, self.compiled_norm)
            if self.compiled_mix is None:
                q = self.mix * x + (1.0 - self.mix) * self.norm_out(f)
            else:
                q = self.compiled_mix(x, f, self.norm_out.weight, self.norm_out.bias, self.norm_out.eps, self.mix)
            return to_local_heads(q, self.config)

    class ReferenceNonlinearQuery(torch.nn.Module):
        def __init__(self, d, width, activation, mix, bias, norm_bias, eps):
            super().__init__()
            self.mix = mix
            self.norm_in = torch.nn.RMSNorm(d, eps=eps)
            self.f = MLP(d, width, bias, activation)
            self.norm_out = torch.nn.LayerNorm(d, eps=eps, bias=norm_bias)

        def forward(self, x):
            return self.mix * x + (1.0 - self.mix) * self.norm_out(self.f(self.norm_in(x)))

    return NonlinearQuery, ReferenceNonlinearQuery


class Nonlinear(MLPArm):
    name = "nonlinear"
    summary = "q = (x + LN(W2 act(W1 RMSNorm x)))/2"
    options = NonlinearQueryConfig
    options_key = "nlq"
    nanogpt_mode = "residual_gelu"  # their x + LN(f(x)) at half scale is this at mix 1/2
    fused_qkv = False
    sequence_parallel = True
    query_is_hidden_width = True

    def query_params(self, m):
        # RMSNorm (d) -> W1 (d -> r) -> act -> W2 (r -> d) -> LayerNorm: +3d vs linear at r = d/2 (+2d without norm bias).
        return self.query_mlp_params(m) | {"nlq_layernorm": norm_params(m, m.hidden_size, "LayerNorm")}

    def activation_elements(self, m, tokens):
        # The MLP's, and W2's output (full vectors on every rank).
        replicated, split = self.normed_mlp_elements(m, tokens)
        return replicated + tokens * m.hidden_size, split

    def recomputed_activation_elements(self, m, tokens):
        return 0.0, 0.0  # only x (kept by linear_kv) and q (kept by the attention) stay

    def megatron_attention(self, m, stock, column_linear):
        from megatron.core.transformer.spec_utils import ModuleSpec

        from nlq_scale.model.attention import query_variant_attention

        o = self.settings(m)
        query = ModuleSpec(
            module=_modules()[0],
            params={"width": self.width(m), "activation": o.activation, "mix": o.mix, "norm_bias": m.norm_bias,
                    "fuse_up": o.fuse_up},
        )
        return query_variant_attention(stock, query, column_linear)

    def reference_query(self, m):
        from nlq_scale.model.query import EPS

        o = self.settings(m)
        return _modules()[1](m.hidden_size, self.width(m), o.activation, o.mix, m.add_bias_linear, m.norm_bias, EPS)

    def export_query(self, m):
        o = self.settings(m)
        mlp = {"weight": 1.0 - o.mix, "width": self.width(m), "activation": o.activation, "out_norm": "layernorm"}
        return export_recipe(x=o.mix, q_mlp=mlp)

    def nanogpt_names(self, m):
        return {
            "residual_rmsnorm_input.weight": "attn.q_mlp.norm_in.weight",
            "residual_in.weight": "attn.q_mlp.up.weight",
            "residual_out.weight": "attn.q_mlp.down.weight",
            "residual_layernorm_output.weight": "attn.q_mlp.norm_out.weight",
        }

    def weight_names(self, m):
        q, mq, ex = "query", "self_attention.query", "attn.q_mlp"
        return [
            *norm_names(m, f"{q}.norm_in", f"{mq}.norm_in", f"{ex}.norm_in", "RMSNorm"),
            *linear_names(m, f"{q}.f.up", f"{mq}.f.up", f"{ex}.up"),
            *linear_names(m, f"{q}.f.down", f"{mq}.f.down", f"{ex}.down"),
            *norm_names(m, f"{q}.norm_out", f"{mq}.norm_out", f"{ex}.norm_out", "LayerNorm"),
        ]


ARM = Nonlinear
