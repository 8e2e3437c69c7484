"""The megatron-core GPT for a run config: TransformerConfig, the arm's layer spec, and the model.

The arm changes exactly one submodule of megatron's stock layer spec (`self_attention`), the
ModuleSpec way; the linear arm *is* megatron's stock spec. The local spec is the CPU path; the
Transformer Engine spec is selectable for GPUs (not exercised on CPU).
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from nlq_scale.config.schema import ModelConfig, ParallelConfig
from nlq_scale.model.accounting import ffn_hidden_size, query_rank, resolve_model
from nlq_scale.model.attention import (
    PreprojAttention,
    PreprojSubmodules,
    QueryVariantAttention,
    QueryVariantSubmodules,
)
from nlq_scale.model.query import IdentityQuery, NonlinearQuery


def softmax_scale(m: ModelConfig) -> float | None:
    """None lets megatron use 1/sqrt(d_k). With W_Q = I the query is not learned to be small, so the
    identity arm halves the scale (1/(2 sqrt(d_k)), as the W_Q-redundancy paper does)."""
    if m.softmax_scale is not None:
        return m.softmax_scale
    if m.arm == "identity":
        return 1.0 / (2.0 * math.sqrt(m.head_dim))
    return None


def transformer_config(m: ModelConfig, p: ParallelConfig) -> TransformerConfig:
    m = resolve_model(m)
    on_gpu = torch.cuda.is_available()
    dtype = torch.bfloat16 if m.bf16 else torch.float32
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.query_groups,
        kv_channels=m.head_dim,
        ffn_hidden_size=ffn_hidden_size(m),
        tensor_model_parallel_size=p.tp,
        pipeline_model_parallel_size=p.pp,
        expert_model_parallel_size=p.ep,
        sequence_parallel=p.sequence_parallel,
        normalization=m.normalization,
        layernorm_epsilon=1e-5,
        add_bias_linear=m.add_bias_linear,
        activation_func=F.gelu,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=m.init_std,
        softmax_scale=softmax_scale(m),
        qk_layernorm=m.qk_norm,
        num_moe_experts=m.moe.num_experts,
        moe_router_topk=m.moe.router_topk,
        moe_aux_loss_coeff=m.moe.aux_loss_coeff,
        # The all-to-all dispatcher needs CUDA streams; the all-gather one runs on CPU (and is fine
        # for EP within a node).
        moe_token_dispatcher_type="alltoall" if on_gpu else "allgather",
        params_dtype=dtype,
        bf16=m.bf16,
        pipeline_dtype=dtype,
        # CPU: initialise full weights on CPU then shard, so every layout starts from the same weights.
        use_cpu_initialization=not on_gpu,
        # Fused kernels exist only on GPU (apex / TE / triton).
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=on_gpu,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        **_recompute(p),
    )


def _recompute(p: ParallelConfig) -> dict:
    """parallel.recompute -> megatron's activation recomputation (what the planner's memory
    estimate assumes)."""
    if p.recompute == "none":
        return {}
    if p.recompute == "selective":
        return {"recompute_granularity": "selective"}  # core attention only
    return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


def _stock_spec(m: ModelConfig) -> ModuleSpec:
    if m.transformer_impl == "transformer_engine":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(num_experts=m.moe.num_experts, qk_layernorm=m.qk_norm)
    return get_gpt_layer_local_spec(
        num_experts=m.moe.num_experts, qk_layernorm=m.qk_norm, normalization=m.normalization
    )


def _query_spec(m: ModelConfig) -> ModuleSpec:
    if m.arm == "identity":
        return ModuleSpec(module=IdentityQuery)
    return ModuleSpec(
        module=NonlinearQuery,
        params={"rank": query_rank(m), "activation": m.nlq.activation, "mix": m.nlq.mix},
    )


def _kv_linear_and_norm(m: ModelConfig):
    """The stock backend's column-parallel linear, and the input norm a non-fused attention needs."""
    if m.transformer_impl == "transformer_engine":
        from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TENorm

        return TEColumnParallelLinear, TENorm
    return ColumnParallelLinear, None


def layer_spec(m: ModelConfig) -> ModuleSpec:
    """Megatron's stock layer spec with the arm's attention swapped in."""
    m = resolve_model(m)
    spec = copy.deepcopy(_stock_spec(m))
    if m.arm == "linear":
        return spec
    stock = spec.submodules.self_attention
    if m.arm == "preproj":
        stock.module = PreprojAttention
        stock.submodules = PreprojSubmodules(
            **vars(stock.submodules),
            rank=query_rank(m),
            activation=m.preproj.activation,
            skip_init_std=m.preproj.skip_init_std,
        )
        return spec
    sub = stock.submodules
    column_linear, norm = _kv_linear_and_norm(m)
    spec.submodules.self_attention = ModuleSpec(
        module=QueryVariantAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=QueryVariantSubmodules(
            query=_query_spec(m),
            linear_kv=column_linear,
            core_attention=sub.core_attention,
            linear_proj=sub.linear_proj,
            q_layernorm=sub.q_layernorm,
            k_layernorm=sub.k_layernorm,
        ),
    )
    if norm is not None:
        # The TE spec fuses input_layernorm into linear_qkv, which this attention does not have.
        spec.submodules.input_layernorm = norm
    return spec


def build_gpt(m: ModelConfig, p: ParallelConfig, pre_process: bool = True, post_process: bool = True) -> GPTModel:
    """This pipeline stage's GPT. Call after parallel_state is initialised and the RNG seeded."""
    config = transformer_config(m, p)
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(m),
        vocab_size=m.padded_vocab_size,
        max_sequence_length=m.seq_length,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=m.tie_embeddings,
        position_embedding_type=m.position_embedding,
        rotary_base=m.rotary_base,
    )
