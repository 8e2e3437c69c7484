"""linear: q = x W_Q, megatron's stock attention (the baseline every arm is compared against)."""

from __future__ import annotations

from nlq_scale.arms.base import Arm, export_recipe, inverse_sqrt_head_dim, linear_names, query_width
from nlq_scale.shape import linear_params


class Linear(Arm):
    name = "linear"
    summary = "q = x W_Q (standard attention)"
    baseline = True
    nanogpt_mode = "original"
    fused_qkv = True
    sequence_parallel = True

    def softmax_scale(self, m):
        return inverse_sqrt_head_dim(m)

    def query_params(self, m):
        return {"linear_q": linear_params(m, m.hidden_size, query_width(m))}

    def activation_elements(self, m, tokens):
        return 0.0, 0.0  # W_Q's output is the q the stock attention already keeps

    def megatron_attention(self, m, stock, column_linear):
        return stock

    def reference_query(self, m):
        from torch import nn

        return nn.Linear(m.hidden_size, query_width(m), bias=m.add_bias_linear)

    def export_query(self, m):
        return export_recipe(q_proj=True)

    def nanogpt_names(self, m):
        return {"c_attn.q": "attn.q_proj.weight"}

    def weight_names(self, m):
        return linear_names(m, "query", "self_attention.linear_qkv", "attn.q_proj")


ARM = Linear
