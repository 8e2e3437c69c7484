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

from nlq_scale.config.schema import ModelConfig


def ffn_hidden_size(m: ModelConfig) -> int:
    return int(round(m.mlp_ratio * m.hidden_size))


def query_rank(m: ModelConfig) -> int:
    """Width r of the query MLP (nonlinear) or pre-projection MLP (preproj); default d/2."""
    sub = m.preproj if m.arm == "preproj" else m.nlq
    return sub.rank or m.hidden_size // 2


def _norm(m: ModelConfig, width: int, kind: str | None = None) -> int:
    kind = kind or m.normalization
    return width * (2 if kind == "LayerNorm" else 1)


def _linear(m: ModelConfig, fan_in: int, fan_out: int) -> int:
    return fan_in * fan_out + (fan_out if m.add_bias_linear else 0)


def query_path_params(m: ModelConfig) -> dict[str, int]:
    """Parameters that differ between arms, per layer, by component name."""
    d, q_width = m.hidden_size, m.num_attention_heads * m.head_dim
    r = query_rank(m)
    if m.arm == "linear":
        return {"linear_q": _linear(m, d, q_width)}
    if m.arm == "identity":
        return {}
    if m.arm == "nonlinear":
        # RMSNorm (d) -> W1 (d -> r) -> act -> W2 (r -> d) -> LayerNorm (2d): +3d vs linear at r = d/2.
        return {
            "nlq_rmsnorm": _norm(m, d, "RMSNorm"),
            "nlq_w1": _linear(m, d, r),
            "nlq_w2": _linear(m, r, d),
            "nlq_layernorm": _norm(m, d, "LayerNorm"),
        }
    # preproj: the linear Q stays; a residual MLP feeds Q/K/V and a content skip joins after attention.
    return {
        "linear_q": _linear(m, d, q_width),
        "preproj_norm": _norm(m, d, "RMSNorm"),
        "preproj_up": _linear(m, d, r),
        "preproj_down": _linear(m, r, d),
        "preproj_skip": _linear(m, d, d),
    }


def layer_params(m: ModelConfig) -> dict[str, int]:
    d, dk = m.hidden_size, m.head_dim
    q_width, kv_width = m.num_attention_heads * dk, 2 * m.query_groups * dk
    ffn = ffn_hidden_size(m)
    parts = {"input_layernorm": _norm(m, d)}
    parts |= query_path_params(m)
    parts["linear_kv"] = _linear(m, d, kv_width)
    if m.qk_norm:
        parts["qk_norm"] = 2 * _norm(m, dk)
    parts["linear_proj"] = _linear(m, q_width, d)
    parts["pre_mlp_layernorm"] = _norm(m, d)
    experts = m.moe.num_experts or 1
    parts["mlp"] = experts * (_linear(m, d, ffn) + _linear(m, ffn, d))
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


def count_parameters(m: ModelConfig) -> ParamCount:
    m = resolve_model(m)
    d, vocab = m.hidden_size, m.padded_vocab_size
    per_layer = layer_params(m)
    blocks = m.num_layers * sum(per_layer.values()) + _norm(m, d)  # + final layernorm
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


def flops_per_token(m: ModelConfig) -> int:
    """Training FLOPs per token (forward + backward)."""
    m = resolve_model(m)
    counts = count_parameters(m)
    matmul = counts.active_non_embedding + m.padded_vocab_size * m.hidden_size
    attention = 12 * m.num_layers * m.seq_length * m.num_attention_heads * m.head_dim
    return 6 * matmul + attention


def resolve_model(m: ModelConfig) -> ModelConfig:
    """Solve `match_params_of` into a concrete mlp_ratio (the control arm's MLP width)."""
    if m.match_params_of is None:
        return m
    target = count_parameters(m.model_copy(update={"arm": m.match_params_of, "match_params_of": None}))
    base = m.model_copy(update={"match_params_of": None})
    deficit = target.non_embedding - count_parameters(base).non_embedding
    experts = m.moe.num_experts or 1
    per_unit = m.num_layers * experts * (2 * m.hidden_size + (1 if m.add_bias_linear else 0))
    ffn = ffn_hidden_size(base) + round(deficit / per_unit)
    if ffn <= 0:
        raise ValueError(f"match_params_of={m.match_params_of}: no positive MLP width matches")
    return base.model_copy(update={"mlp_ratio": ffn / m.hidden_size})
