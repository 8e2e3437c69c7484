"""identity: W_Q = I, q = x; attention scale 1/(2 sqrt(d_k)) (the W_Q-redundancy paper's setting:
an identity query is not learned to be small)."""

from __future__ import annotations

from nlq_scale.arms.base import Arm, export_recipe, inverse_sqrt_head_dim


class Identity(Arm):
    name = "identity"
    summary = "q = x (no query weights)"
    nanogpt_mode = "identity"  # their scale is halved too
    fused_qkv = False
    sequence_parallel = True
    query_is_hidden_width = True

    def softmax_scale(self, m):
        return inverse_sqrt_head_dim(m) / 2

    def query_params(self, m):
        return {}

    def activation_elements(self, m, tokens):
        return 0.0, 0.0  # q is a view of the layer input, which the stock count already holds

    def megatron_attention(self, m, stock, column_linear):
        from megatron.core.transformer.spec_utils import ModuleSpec

        from nlq_scale.model.attention import query_variant_attention
        from nlq_scale.model.query import ScatterToHeads

        return query_variant_attention(stock, ModuleSpec(module=ScatterToHeads), column_linear)

    def reference_query(self, m):
        from torch import nn

        return nn.Identity()

    def export_query(self, m):
        return export_recipe(x=1.0)

    def weight_names(self, m):
        return []


ARM = Identity
