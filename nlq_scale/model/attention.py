"""The attention of arms with their own query module (`Arm.fused_qkv = False`), built by
subclassing megatron-core's attention so that RoPE, core attention, the output projection and the
inference KV cache stay megatron's own: K/V from a KV-only column-parallel projection of width
2 * d_kv, laid out per query group as [k_g | v_g]; Q from the arm's query module, then the q/k norms
(model.qk_norm) on the final per-head query and key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

import torch
from megatron.core.transformer.attention import Attention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor

from nlq_scale.model.graphed import GraphedQuery
from nlq_scale.model.query import recomputed


@dataclass
class QueryVariantSubmodules:
    query: Union[ModuleSpec, type]
    linear_kv: Any
    core_attention: Any
    linear_proj: Union[ModuleSpec, type, None] = None
    q_layernorm: Any = None  # a norm class or functools.partial; None or IdentityOp: no norm
    k_layernorm: Any = None


def _head_norm(norm: Any, config: TransformerConfig, head_dim: int):
    """A q/k norm as megatron's SelfAttention builds it: since megatron-core 0.17 a layer calls its
    norms directly (no ModuleSpec), and IdentityOp in the stock spec means none."""
    if norm is None or norm is IdentityOp:
        return None
    return norm(hidden_size=head_dim, config=config, eps=config.layernorm_epsilon)


class QueryVariantAttention(Attention):
    def __init__(
        self,
        config: TransformerConfig,
        submodules: QueryVariantSubmodules,
        layer_number: int,
        attn_mask_type: AttnMaskType = AttnMaskType.causal,
        cp_comm_type: str | None = None,
        pg_collection=None,
        pp_layer_offset: int | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__(
            config=config,
            submodules=submodules,
            layer_number=layer_number,
            attn_mask_type=attn_mask_type,
            attention_type="self",
            cp_comm_type=cp_comm_type,
            pg_collection=pg_collection,
            pp_layer_offset=pp_layer_offset,
            name=name,
        )
        self.query = build_module(submodules.query, config=self.config, tp_group=self.pg_collection.tp)
        self.graphed_query = GraphedQuery(self.query) if self.config.graph_query else None
        self.linear_kv = build_module(
            submodules.linear_kv,
            self.config.hidden_size,
            2 * self.kv_projection_size,
            config=self.config,
            init_method=self.config.init_method,
            gather_output=False,
            bias=self.config.add_bias_linear,
            skip_bias_add=False,
            is_expert=False,
            tp_comm_buffer_name="kv",
            tp_group=self.pg_collection.tp,
            name=None if name is None else f"{name}.linear_kv",
        )
        self.q_layernorm = _head_norm(submodules.q_layernorm, self.config, self.hidden_size_per_attention_head)
        self.k_layernorm = _head_norm(submodules.k_layernorm, self.config, self.hidden_size_per_attention_head)

    def get_query_key_value_tensors(
        self,
        hidden_states: Tensor,
        key_value_states: Tensor | None = None,
        output_gate: bool = False,
        split_qkv: bool = True,
    ) -> tuple[Tensor, Tensor, Tensor]:
        if output_gate or not split_qkv:
            raise NotImplementedError("query-variant attention has no output gate or fused QKV-RoPE path")
        head_dim = self.hidden_size_per_attention_head
        kv, _ = self.linear_kv(hidden_states)
        kv = kv.view(*kv.shape[:-1], self.num_query_groups_per_partition, 2 * head_dim)
        key, value = torch.split(kv, head_dim, dim=-1)
        if self.graphed_query is not None:
            query = self.graphed_query(hidden_states)
        else:
            query = recomputed(self.query, hidden_states, self.config.recompute_query)
        query = query.view(*query.shape[:-1], self.num_attention_heads_per_partition, head_dim)
        if self.q_layernorm is not None:
            query = self.q_layernorm(query)
        if self.k_layernorm is not None:
            key = self.k_layernorm(key)
        return query, key, value


def query_variant_attention(stock: ModuleSpec, query: ModuleSpec, column_linear: type) -> ModuleSpec:
    """The stock self_attention spec with its fused QKV replaced by `query` + a KV-only projection."""
    sub = stock.submodules
    return ModuleSpec(
        module=QueryVariantAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=QueryVariantSubmodules(
            query=query,
            linear_kv=column_linear,
            core_attention=sub.core_attention,
            linear_proj=sub.linear_proj,
            q_layernorm=sub.q_layernorm,
            k_layernorm=sub.k_layernorm,
        ),
    )
