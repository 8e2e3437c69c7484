"""nonlinear-ph: the nonlinear query with per-head norms, as in the public GPT-3 Large (760M) audit
of the nonlinear-query paper (its `residual_gelu` mode with `per_head_norm`):

    q_h = rms_h(x) + g_h * rms_h(W2 act(W1 RMSNorm x))     for every head h,

where rms_h(t) = t_h / sqrt(mean(t_h^2) + eps) over the head's head_dim channels (no parameters),
g_h the head's slice of a learned gain (d in all, initialized to 1), eps = model.layernorm eps
(1e-5, the audit's). Both terms have a per-head RMS of 1 (the second times |g_h|), so |q_h| is
bounded per token rather than in expectation; the attention scale is therefore not halved: 1/sqrt(d_k).
"""

from __future__ import annotations

from functools import cache

from nlq_scale.arms.base import (
    MLPArm,
    NormedQueryMLPOptions,
    WeightName,
    export_recipe,
    linear_names,
    norm_names,
)


class PerHeadNonlinearQueryConfig(NormedQueryMLPOptions):
    """model.nlq_ph: f's width r (W1: d -> r, W2: r -> d), activation and fused RMSNorm."""

    section = "nlq_ph"


@cache
def _modules():
    """The megatron and reference query modules (torch is imported only when a model is built)."""
    import torch
    from megatron.core.transformer.module import MegatronModule

    from nlq_scale.model.query import ParallelMLP, compiled, normed_mlp, on_sequence_shard, rms_norm, to_local_heads
    from nlq_scale.model.query import MLP

    def head_rms(t, heads: int, eps: float):
        """Each head's slice of the last dim divided by its RMS (t: [..., heads * head_dim])."""
        h = t.unflatten(-1, (heads, -1))
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2)

    def per_head_query(x, f, gain, heads: int, eps: float):
        return head_rms(x, heads, eps) + gain * head_rms(f, heads, eps)

    class PerHeadNonlinearQuery(MegatronModule):
        """The whole query on the full hidden vector of each token, every rank or this rank's
        sequence shard (the RMSNorm and the gain replicated, f's W1/W2 split over TP), then sent to
        this rank's heads."""

        def __init__(self, config, width, activation, fuse_up, tp_group=None, **_unused):
            super().__init__(config=config)
            d, self.fuse_up = config.hidden_size, fuse_up
            self.heads, self.eps = config.num_attention_heads, config.layernorm_epsilon
            self.norm_in = on_sequence_shard(torch.nn.RMSNorm(d, eps=self.eps, dtype=config.params_dtype), config)
            self.f = ParallelMLP(config, width, activation, tp_group)
            gain = torch.nn.Parameter(torch.ones(d, dtype=config.params_dtype))
            self.head_norm_gain = on_sequence_shard(gain, config)
            self.compiled_norm = compiled(rms_norm, config.compile_query)
            self.query_from = compiled(per_head_query, config.compile_query) or per_head_query

        def forward(self, x):
            f = normed_mlp(self.norm_in, self.f, x, self.fuse_up, self.compiled_norm)
            return to_local_heads(self.query_from(x, f, self.head_norm_gain, self.heads, self.eps), self.config)

    class ReferencePerHeadNonlinearQuery(torch.nn.Module):
        def __init__(self, d, heads, width, activation, bias, eps):
            super().__init__()
            self.heads, self.eps = heads, eps
            self.norm_in = torch.nn.RMSNorm(d, eps=eps)
            self.f = MLP(d, width, bias, activation)
            self.head_norm_gain = torch.nn.Parameter(torch.ones(d))

        def forward(self, x):
            return per_head_query(x, self.f(self.norm_in(x)), self.head_norm_gain, self.heads, self.eps)

    return PerHeadNonlinearQuery, ReferencePerHeadNonlinearQuery


class PerHeadNonlinear(MLPArm):
    name = "nonlinear-ph"
    summary = "q_h = rms_h(x) + g_h * rms_h(W2 act(W1 RMSNorm x)) per head (the 760M audit's per-head variant)"
    options = PerHeadNonlinearQueryConfig
    options_key = "nlq_ph"
    fused_qkv = False
    sequence_parallel = True
    query_is_hidden_width = True

    def query_params(self, m):
        # RMSNorm (d) -> W1 (d -> r) -> act -> W2 (r -> d) -> per-head gain (d): +3d vs linear at r = d/2.
        return self.query_mlp_params(m) | {"nlq_head_norm_gain": m.hidden_size}

    def activation_elements(self, m, tokens):
        # The MLP's, and W2's output and its per-head-normed copy (full vectors on every rank).
        replicated, split = self.normed_mlp_elements(m, tokens)
        return replicated + tokens * 2 * m.hidden_size, split

    def recomputed_activation_elements(self, m, tokens):
        return 0.0, 0.0  # only x (kept by linear_kv) and q (kept by the attention) stay

    def megatron_attention(self, m, stock, column_linear):
        from megatron.core.transformer.spec_utils import ModuleSpec

        from nlq_scale.model.attention import query_variant_attention

        o = self.settings(m)
        query = ModuleSpec(module=_modules()[0], params={"width": self.width(m), "activation": o.activation,
                                                                "fuse_up": o.fuse_up})
        return query_variant_attention(stock, query, column_linear)

    def reference_query(self, m):
        from nlq_scale.model.query import EPS

        o = self.settings(m)
        return _modules()[1](m.hidden_size, m.num_attention_heads, self.width(m), o.activation, m.add_bias_linear, EPS)

    def export_query(self, m):
        o = self.settings(m)
        mlp = {"weight": 1.0, "width": self.width(m), "activation": o.activation, "out_norm": "head_rms_gain"}
        return export_recipe(x=1.0, x_head_rms=True, q_mlp=mlp)

    def weight_names(self, m):
        q, mq, ex = "query", "self_attention.query", "attn.q_mlp"
        return [
            *norm_names(m, f"{q}.norm_in", f"{mq}.norm_in", f"{ex}.norm_in", "RMSNorm"),
            *linear_names(m, f"{q}.f.up", f"{mq}.f.up", f"{ex}.up"),
            *linear_names(m, f"{q}.f.down", f"{mq}.f.down", f"{ex}.down"),
            WeightName(f"{q}.head_norm_gain", f"{mq}.head_norm_gain", f"{ex}.head_norm_gain", False),
        ]


ARM = PerHeadNonlinear
