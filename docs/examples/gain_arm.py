"""gain: q = g * x, a learned per-channel gain on the layer input (the identity arm plus d
parameters per layer). The example of docs/arms.md; tests/test_arms.py registers it through
$NLQ_SCALE_ARMS and runs it through the conformance suite."""

from __future__ import annotations

from functools import cache

from pydantic import Field

from nlq_scale.arms.base import Arm, WeightName, inverse_sqrt_head_dim
from nlq_scale.strict import Strict


class GainConfig(Strict):
    """model.gain: the query gain."""

    init: float = Field(1.0, description="initial value of every gain")


@cache
def _modules():
    """Torch and megatron are imported only when a model is built (config loading stays cheap)."""
    import torch
    from megatron.core.tensor_parallel.mappings import scatter_to_tensor_model_parallel_region
    from megatron.core.transformer.module import MegatronModule

    class GainQuery(MegatronModule):
        """The gain is replicated on every tensor-parallel rank; the query is scattered to the rank's heads."""

        def __init__(self, config, init, **_unused):
            super().__init__(config=config)
            self.gain = torch.nn.Parameter(torch.full((config.hidden_size,), init, dtype=config.params_dtype))

        def forward(self, x):
            return scatter_to_tensor_model_parallel_region(self.gain * x)

    class ReferenceGainQuery(torch.nn.Module):
        def __init__(self, d, init):
            super().__init__()
            self.gain = torch.nn.Parameter(torch.full((d,), init))

        def forward(self, x):
            return self.gain * x

    return GainQuery, ReferenceGainQuery


class Gain(Arm):
    name = "gain"
    summary = "q = g * x (learned per-channel gain)"
    options = GainConfig
    options_key = "gain"
    fused_qkv = False  # its own query module; K/V from megatron's linear_kv
    query_is_hidden_width = True

    def softmax_scale(self, m):
        return inverse_sqrt_head_dim(m) / 2  # as identity: the query is not learned to be small

    def query_params(self, m):
        return {"query_gain_norm": m.hidden_size}  # "norm" in the name: replicated across TP ranks

    def activation_elements(self, m, tokens):
        return tokens * m.hidden_size, 0.0  # g * x, kept for the gain's gradient

    def megatron_attention(self, m, stock, column_linear):
        from megatron.core.transformer.spec_utils import ModuleSpec

        from nlq_scale.model.attention import query_variant_attention

        query = ModuleSpec(module=_modules()[0], params={"init": self.settings(m).init})
        return query_variant_attention(stock, query, column_linear)

    def reference_query(self, m):
        return _modules()[1](m.hidden_size, self.settings(m).init)

    def weight_names(self, m):
        return [WeightName("query.gain", "self_attention.query.gain", "attn.q_gain", matrix=False)]


ARM = Gain
