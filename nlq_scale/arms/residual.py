"""residual: q = x + x W_Q (the nonlinear-query authors' "residual" query mode); scale 1/sqrt(d_k)."""

from __future__ import annotations

from functools import cache

from nlq_scale.arms.base import Arm, export_recipe, inverse_sqrt_head_dim, linear_names, query_width
from nlq_scale.shape import linear_params


@cache
def _modules():
    """The megatron and reference query modules (torch is imported only when a model is built)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.module import MegatronModule
    from torch import nn

    from nlq_scale.model.query import to_local_heads

    class ResidualQuery(MegatronModule):
        """x + x W_Q: W_Q column-parallel over heads (gathering the sequence under sequence
        parallelism), x sent to this rank's heads."""

        def __init__(self, config, tp_group=None, **_unused):
            super().__init__(config=config)
            self.linear_q = ColumnParallelLinear(
                config.hidden_size, config.num_attention_heads * config.kv_channels, config=config,
                init_method=config.init_method, bias=config.add_bias_linear, gather_output=False,
                skip_bias_add=False, is_expert=False, tp_group=tp_group,
            )

        def forward(self, x):
            q, _ = self.linear_q(x)
            return to_local_heads(x, self.config) + q

    class ReferenceResidualQuery(nn.Module):
        def __init__(self, d, bias):
            super().__init__()
            self.linear_q = nn.Linear(d, d, bias=bias)

        def forward(self, x):
            return x + self.linear_q(x)

    return ResidualQuery, ReferenceResidualQuery


class Residual(Arm):
    name = "residual"
    summary = "q = x + x W_Q"
    nanogpt_mode = "residual"
    fused_qkv = False
    sequence_parallel = True
    query_is_hidden_width = True

    def softmax_scale(self, m):
        return inverse_sqrt_head_dim(m)

    def query_params(self, m):
        return {"linear_q": linear_params(m, m.hidden_size, query_width(m))}

    def activation_elements(self, m, tokens):
        return 0.0, 0.0  # W_Q's input is the layer input and the sum is the q already counted

    def megatron_attention(self, m, stock, column_linear):
        from megatron.core.transformer.spec_utils import ModuleSpec

        from nlq_scale.model.attention import query_variant_attention

        return query_variant_attention(stock, ModuleSpec(module=_modules()[0]), column_linear)

    def reference_query(self, m):
        return _modules()[1](m.hidden_size, m.add_bias_linear)

    def export_query(self, m):
        return export_recipe(x=1.0, q_proj=True)

    def nanogpt_names(self, m):
        return {"c_attn.q": "attn.q_proj.weight"}

    def weight_names(self, m):
        return linear_names(m, "query.linear_q", "self_attention.query.linear_q", "attn.q_proj")


ARM = Residual
