"""Core attention through torch's scaled_dot_product_attention (model.core_attention=sdpa).

megatron's local DotProductAttention materializes the [b, heads, s, s] scores and probabilities
(baddbmm, a separate softmax, bmm) and keeps the probabilities for backward. SDPA runs torch's fused
kernels instead (flash / memory-efficient on CUDA, a flash kernel on the CPU), which keep only the
softmax statistics. The subclass keeps megatron's constructor (heads and scale per partition, the
process groups, the sharded state dict) and its forward for every case SDPA is not asked to cover:
an explicit mask, attention bias, packed sequences, sliding windows, a softmax offset, query-key
layer scaling, attention dropout while training, or a causal chunk of queries against a longer cache.
"""

from __future__ import annotations

import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from torch import Tensor


class SDPAttention(DotProductAttention):
    def _sdpa_covers(self, attention_mask, mask_type, attention_bias, packed_seq_params, causal_square: bool) -> bool:
        return (
            attention_mask is None
            and attention_bias is None
            and packed_seq_params is None
            and mask_type in (AttnMaskType.causal, AttnMaskType.no_mask)
            and causal_square  # SDPA's causal mask is aligned top-left, megatron's bottom-right
            and self.scale_mask_softmax.window_size is None
            and self.softmax_offset is None
            and not self.config.apply_query_key_layer_scaling
            and not (self.training and self.attention_dropout.p > 0)
        )

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params=None,
    ) -> Tensor:
        """query [sq, b, heads, d], key/value [sk, b, groups, d] -> context [sq, b, heads * d]."""
        sq, sk = query.shape[0], key.shape[0]
        mask_type = attn_mask_type or self.attn_mask_type
        # megatron masks causally only where sq > 1 (a prompt: sq == sk); past the prompt its inference
        # path asks for no mask, and each new query sees every cached key.
        causal = mask_type == AttnMaskType.causal and sq > 1
        if not self._sdpa_covers(attention_mask, mask_type, attention_bias, packed_seq_params, not causal or sq == sk):
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads or groups, s, d]
        context = F.scaled_dot_product_attention(
            q,
            k,
            v,
            is_causal=causal,
            scale=self.softmax_scale,
            enable_gqa=self.num_attention_heads_per_partition != self.num_query_groups_per_partition,
        )
        return context.permute(2, 0, 1, 3).reshape(sq, context.shape[0], self.hidden_size_per_partition)
