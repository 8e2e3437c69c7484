"""Parameter and FLOP accounting, in closed form from the config (no torch), so the planner and the
analysis can price a 175B run without building it. tests/test_accounting.py checks every count
against the parameters of the megatron-core model the builder actually creates.

Conventions: non-embedding parameters exclude the token and position embeddings and an untied
output layer (Kaplan et al.; the nonlinear-query paper counts this way). Training FLOPs per token
follow PaLM / nanoGPT's MFU estimate: 6 x (matmul parameters, including the logit projection)
+ 12 x layers x seq x attention width (QK^T and AV, forward and backward, not halved for causality).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nlq_scale import arms
from nlq_scale.shape import ModelShape, linear_params, norm_params


def ffn_hidden_size(m: ModelShape) -> int:
    """The MLP width: model.ffn_hidden_size (which loading solves for a parameter-matched control),
    else mlp_ratio x hidden_size."""
    return m.ffn_hidden_size or int(round(m.mlp_ratio * m.hidden_size))


def layer_params(m: ModelShape) -> dict[str, int]:
    d, dk = m.hidden_size, m.head_dim
    q_width, kv_width = m.num_attention_heads * dk, 2 * m.query_groups * dk
    ffn = ffn_hidden_size(m)
    parts = {"input_layernorm": norm_params(m, d)}
    parts |= arms.get(m.arm).query_params(m)
    parts["linear_kv"] = linear_params(m, d, kv_width)
    if m.qk_norm == "learned":
        parts["qk_norm"] = 2 * norm_params(m, dk)
    parts["linear_proj"] = linear_params(m, q_width, d)
    parts["pre_mlp_layernorm"] = norm_params(m, d)
    experts = m.moe.num_experts or 1
    parts["mlp"] = experts * (linear_params(m, d, ffn) + linear_params(m, ffn, d))
    if m.moe.num_experts:
        parts["router"] = d * m.moe.num_experts
    return parts


@dataclass(frozen=True)
class ParamCount:
    total: int
    non_embedding: int
    embedding: int
    per_layer: dict[str, int] = field(default_factory=dict)
    active_non_embedding: int = 0  # MoE: only router_topk experts run per token

    def as_dict(self) -> dict:
        return {
            "total": self.total,
            "non_embedding": self.non_embedding,
            "embedding": self.embedding,
            "active_non_embedding": self.active_non_embedding,
            "per_layer": self.per_layer,
        }


def count_parameters(m: ModelShape) -> ParamCount:
    d, vocab = m.hidden_size, m.padded_vocab_size
    per_layer = layer_params(m)
    blocks = m.num_layers * sum(per_layer.values()) + norm_params(m, d)  # + final layernorm
    embedding = vocab * d
    if m.position_embedding == "learned_absolute":
        embedding += m.seq_length * d
    if not m.tie_embeddings:
        embedding += vocab * d
    active = blocks
    if m.moe.num_experts:
        inactive = m.moe.num_experts - min(m.moe.router_topk, m.moe.num_experts)
        active -= m.num_layers * inactive * per_layer["mlp"] // m.moe.num_experts
    return ParamCount(blocks + embedding, blocks, embedding, per_layer, active)


def flops_per_token(m: ModelShape) -> int:
    """Training FLOPs per token (forward + backward)."""
    arm = arms.get(m.arm)
    counts = count_parameters(m)
    # 6 x every parameter outside the query path (it prices its own), + the logit projection.
    rest = counts.active_non_embedding - m.num_layers * sum(arm.query_params(m).values())
    matmul = 6 * (rest + m.padded_vocab_size * m.hidden_size) + m.num_layers * arm.query_flops(m)
    attention = 12 * m.num_layers * m.seq_length * m.num_attention_heads * m.head_dim
    return matmul + attention


def matched_ffn_hidden_size(m: ModelShape) -> int:
    """The MLP width at which m's non-embedding parameters equal those of arm `m.match_params_of` at
    the same shape (the parameter-matched control). The config's validation calls this once, when
    the config is loaded, and stores the result in model.ffn_hidden_size."""
    free = m.model_copy(update={"match_params_of": None, "ffn_hidden_size": None})
    target = count_parameters(free.model_copy(update={"arm": m.match_params_of}))
    deficit = target.non_embedding - count_parameters(free).non_embedding
    experts = m.moe.num_experts or 1
    per_unit = m.num_layers * experts * (2 * m.hidden_size + (1 if m.add_bias_linear else 0))
    ffn = ffn_hidden_size(free) + round(deficit / per_unit)
    if ffn <= 0:
        raise ValueError(f"match_params_of={m.match_params_of}: no positive MLP width matches")
    return ffn
