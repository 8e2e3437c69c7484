"""The megatron-core GPT for a run config: TransformerConfig, the arm's layer spec, and the model.

The arm (nlq_scale.arms) changes exactly one submodule of megatron's stock layer spec
(`self_attention`), the ModuleSpec way; the baseline linear arm *is* megatron's stock spec. The
local spec is the CPU path; the Transformer Engine spec is selectable for GPUs (not exercised on CPU).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig

from nlq_scale import arms
from nlq_scale.config.schema import ModelConfig, ParallelConfig
from nlq_scale.model import mup
from nlq_scale.model.accounting import ffn_hidden_size
from nlq_scale.model.core_attention import SDPAttention
from nlq_scale.model.norms import BlockNorm, HeadRMSNorm


@dataclass
class NLQTransformerConfig(TransformerConfig):
    """megatron's TransformerConfig plus what the arms' modules read from it."""

    recompute_query: bool = False  # parallel.recompute_query, where the arm has a query path to recompute
    compile_query: bool = False  # parallel.compile_query
    graph_query: bool = False  # parallel.graph_query


def softmax_scale(m: ModelConfig) -> float:
    """model.softmax_scale, or the arm's default (under muP with a base head dim, moved towards 1/d_head:
    mup.attention_multiplier). Always set, so megatron's muP never computes its own."""
    if m.softmax_scale is not None:
        return m.softmax_scale
    return arms.get(m.arm).softmax_scale(m) * mup.attention_multiplier(m)


def transformer_config(
    m: ModelConfig, p: ParallelConfig, device: torch.device | None = None, deterministic: bool = False
) -> NLQTransformerConfig:
    """`device`: where the model will compute (None: CUDA when available). On CUDA megatron creates
    its weights on the current device; fused kernels are asked for only where they are installed.
    `deterministic` (runtime.deterministic) picks megatron's deterministic code paths on CUDA."""
    from nlq_scale.runtime.kernels import probe

    on_gpu = torch.cuda.is_available() if device is None else device.type == "cuda"
    kernels = probe()
    dtype = torch.bfloat16 if m.bf16 else torch.float32
    return NLQTransformerConfig(
        recompute_query=arms.get(m.arm).recomputes_query(m, p.recompute_query),
        compile_query=p.compile_query,
        graph_query=p.graph_query,
        # No module list: local graphs capture the whole layer, and full_iteration takes none.
        cuda_graph_impl=p.cuda_graph_impl,
        cuda_graph_modules=[],
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
        # muP's init and logit multiplier are megatron's own; the attention scale stays ours.
        **mup.megatron_fields(m),
        softmax_scale=softmax_scale(m),
        # megatron builds the q/k norms the spec names only when this is set (it refuses a spec norm
        # otherwise); model.qk_norm=rms names our parameter-free one.
        qk_layernorm=m.qk_norm != "none",
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
        masked_softmax_fusion=on_gpu and kernels.fused_softmax,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        # The embedding's gradient through indexing, which torch's deterministic mode sums in a fixed
        # order (F.embedding's CUDA backward does not promise one). The CPU path stays as it is.
        deterministic_mode=on_gpu and deterministic,
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
    learned = m.qk_norm == "learned"
    if m.transformer_impl == "transformer_engine":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec(num_experts=m.moe.num_experts, qk_layernorm=learned)
    else:
        spec = get_gpt_layer_local_spec(num_experts=m.moe.num_experts, qk_layernorm=learned, normalization=m.normalization)
    attention = spec.submodules.self_attention.submodules
    if m.core_attention == "sdpa":
        attention.core_attention = SDPAttention
    if m.qk_norm == "rms":
        attention.q_layernorm = attention.k_layernorm = HeadRMSNorm
    if _block_norms_are_ours(m):
        norm = block_norm(m)
        spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = norm
        if learned:
            attention.q_layernorm = attention.k_layernorm = norm
    return spec


def _block_norms_are_ours(m: ModelConfig) -> bool:
    """The local backend's norms are always BlockNorm (megatron's torch norm refuses sequence
    parallelism; the same torch modules otherwise); TE's only where it has no bias-free LayerNorm."""
    return m.transformer_impl != "transformer_engine" or not m.norm_bias


def _kv_linear_and_norm(m: ModelConfig):
    """The stock backend's column-parallel linear, and the input norm a non-fused attention needs."""
    if m.transformer_impl == "transformer_engine":
        from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TENorm

        return TEColumnParallelLinear, TENorm
    return ColumnParallelLinear, None


def layer_spec(m: ModelConfig) -> ModuleSpec:
    """Megatron's stock layer spec with the arm's attention swapped in. Needs no resolved config:
    the MLP width (what match_params_of solves) comes from the TransformerConfig."""
    arm = arms.get(m.arm)
    spec = _stock_spec(m)
    column_linear, norm = _kv_linear_and_norm(m)
    spec.submodules.self_attention = arm.megatron_attention(m, spec.submodules.self_attention, column_linear)
    if not arm.fused_qkv and norm is not None:
        # The TE spec fuses input_layernorm into linear_qkv, which this attention does not have.
        spec.submodules.input_layernorm = norm
    return spec


def block_spec(m: ModelConfig, config: TransformerConfig) -> ModuleSpec | TransformerBlockSubmodules:
    """This pipeline stage's layers, and the final norm: ours where the layers' norms are."""
    spec = layer_spec(m)
    if not _block_norms_are_ours(m):
        return spec
    return TransformerBlockSubmodules(
        layer_specs=[spec] * get_num_layers_to_build(config),
        layer_norm=block_norm(m),
    )


def block_norm(m: ModelConfig) -> functools.partial:
    """Our block norm as megatron-core (>= 0.17) takes a norm: a callable it calls with hidden_size,
    config and eps, not a ModuleSpec."""
    return functools.partial(BlockNorm, bias=m.norm_bias)


def seed_init(seed: int, cuda_graphs: bool = False) -> None:
    """Seed every generator the initial weights draw from. megatron's model_parallel_cuda_manual_seed
    seeds CUDA's only, but megatron's torch norms, the position embeddings and the arms' torch.nn
    modules are made (and initialised) on the host. On the CPU the shim routes CUDA's seed to the
    host generator, so only a GPU run showed the difference: every process started from other
    weights (measured on an H200). `cuda_graphs` (parallel.cuda_graph_impl): megatron's graphs need
    its graph-safe RNG tracker, made afresh (the process may hold one made without)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=cuda_graphs, force_reset_rng=cuda_graphs)


def build_gpt(
    m: ModelConfig,
    p: ParallelConfig,
    pre_process: bool = True,
    post_process: bool = True,
    device: torch.device | None = None,
    deterministic: bool = False,
) -> GPTModel:
    """This pipeline stage's GPT. Call after parallel_state is initialised and the RNG seeded."""
    config = transformer_config(m, p, device, deterministic)
    model = GPTModel(
        config=config,
        transformer_layer_spec=block_spec(m, config),
        vocab_size=m.padded_vocab_size,
        max_sequence_length=m.seq_length,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=m.tie_embeddings,
        position_embedding_type=m.position_embedding,
        rotary_base=m.rotary_base,
    )
    return model
