"""A transformers model for nlq-scale GPTs whose query path no stock class expresses.

This file is copied into every export that needs it and loaded with `trust_remote_code=True`, so it
imports only torch and transformers (never nlq_scale). The query path is composed from
`config.query` (written by the exporter from the arm's recipe):

  x' = x + pre.down(act(pre.up(pre.norm(x))))          when query["pre"]   (else x' = x)
  q  = query["x"] * x' + q_proj(x')                     (q_proj when query["q_proj"])
       + w * q_mlp.norm_out(q_mlp.down(act(q_mlp.up(q_mlp.norm_in(x')))))   when query["q_mlp"]
  with query["x_head_rms"], x' in the first term is divided by each head's RMS; with q_mlp's
  out_norm "head_rms_gain", norm_out(y) is q_mlp.head_norm_gain * (y divided by each head's RMS).
  K, V from x'; attention; o_proj; + skip(x')           when query["skip"]

Generation keeps K and V (after the QK-norm and RoPE) in transformers' cache, so each step computes
only the new token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

# The activations the harness offers (nlq_scale.model.query.ACTIVATIONS), restated: no nlq_scale here.
ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu, "relu2": lambda x: F.relu(x).square(), "silu": F.silu}
HEAD_RMS_EPS = 1e-6  # the parameter-free QK-norm's epsilon (qk_norm="rms")


class NlqConfig(PretrainedConfig):
    model_type = "nlq_gpt"

    def __init__(
        self,
        vocab_size: int = 50304,
        hidden_size: int = 768,
        num_hidden_layers: int = 12,
        num_attention_heads: int = 12,
        num_key_value_heads: int = 12,
        head_dim: int = 64,
        intermediate_size: int = 3072,
        max_position_embeddings: int = 1024,
        position_embedding: str = "learned_absolute",
        rope_theta: float = 10000.0,
        normalization: str = "LayerNorm",
        norm_bias: bool = True,
        norm_eps: float = 1e-5,
        qk_norm: str = "none",
        bias: bool = False,
        softmax_scale: float | None = None,
        logits_scale: float = 1.0,
        query: dict | None = None,
        num_experts: int | None = None,
        router_topk: int = 2,
        tie_word_embeddings: bool = True,
        use_cache: bool = True,
        **kwargs,
    ) -> None:
        self.use_cache = use_cache
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.intermediate_size = intermediate_size
        self.max_position_embeddings = max_position_embeddings
        self.position_embedding = position_embedding
        self.rope_theta = rope_theta
        self.normalization = normalization
        self.norm_bias = norm_bias
        self.norm_eps = norm_eps
        self.qk_norm = qk_norm
        self.bias = bias
        self.softmax_scale = softmax_scale if softmax_scale is not None else head_dim**-0.5
        self.logits_scale = logits_scale  # muP's output multiplier
        self.query = query or {"x": 0.0, "q_proj": True, "q_mlp": None, "pre": None, "skip": False}
        self.num_experts = num_experts  # None: a dense MLP
        self.router_topk = router_topk
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)


def _norm(config: NlqConfig, width: int, kind: str | None = None) -> nn.Module:
    if (kind or config.normalization) == "LayerNorm":
        return nn.LayerNorm(width, eps=config.norm_eps, bias=config.norm_bias)
    return nn.RMSNorm(width, eps=config.norm_eps)


class HeadRMSNorm(nn.Module):
    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + HEAD_RMS_EPS)


def _head_norm(config: NlqConfig) -> nn.Module:
    if config.qk_norm == "learned":
        return _norm(config, config.head_dim)
    return HeadRMSNorm() if config.qk_norm == "rms" else nn.Identity()


def head_rms(t: torch.Tensor, heads: int, eps: float) -> torch.Tensor:
    """Each head's slice of the last dim divided by its RMS."""
    h = t.unflatten(-1, (heads, -1))
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2)


class MLP(nn.Module):
    """down(act(up(norm_in(x)))), then norm_out: the FFN (no norms), the pre-projection (norm_in)
    and the nonlinear query (both)."""

    def __init__(
        self, config, width, activation="gelu", norm_in=None, norm_out=None, in_name="norm_in", head_gain=False
    ):
        super().__init__()
        if head_gain:  # norm_out is head_norm_gain * (y divided by each head's RMS)
            self.head_norm_gain = nn.Parameter(torch.ones(config.hidden_size))
            self.heads, self.eps = config.num_attention_heads, config.norm_eps
        d = config.hidden_size
        if norm_in is not None:
            setattr(self, in_name, norm_in)
        self._in_name = in_name if norm_in is not None else None
        self.up = nn.Linear(d, width, bias=config.bias)
        self.down = nn.Linear(width, d, bias=config.bias)
        self.norm_out = norm_out
        self.act = ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._in_name is not None:
            x = getattr(self, self._in_name)(x)
        y = self.down(self.act(self.up(x)))
        if hasattr(self, "head_norm_gain"):
            return self.head_norm_gain * head_rms(y, self.heads, self.eps)
        return y if self.norm_out is None else self.norm_out(y)


class MoE(nn.Module):
    """Megatron-core's dropless top-k MoE as the harness configures it: the router's top-k logits per
    token, a softmax over those k only, and the experts' outputs summed with those weights."""

    def __init__(self, config: NlqConfig) -> None:
        super().__init__()
        self.router = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(config, config.intermediate_size) for _ in range(config.num_experts))
        self.topk = config.router_topk

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        top, chosen = self.router(flat).topk(self.topk, dim=-1)
        weights = torch.softmax(top, dim=-1, dtype=torch.float32).type_as(flat)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = (chosen == e).nonzero(as_tuple=True)
            if token.numel():
                out.index_add_(0, token, expert(flat[token]) * weights[token, slot, None])
        return out.view_as(x)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: NlqConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        d, dk, bias, q = config.hidden_size, config.head_dim, config.bias, config.query
        self.heads, self.groups, self.head_dim = config.num_attention_heads, config.num_key_value_heads, dk
        self.scale, self.x_weight, self.x_head_rms = config.softmax_scale, q["x"], q.get("x_head_rms", False)
        self.eps = config.norm_eps
        self.pre = None
        if q["pre"]:
            rms = _norm(config, d, "RMSNorm")
            self.pre = MLP(config, q["pre"]["width"], q["pre"]["activation"], norm_in=rms, in_name="norm")
        self.q_proj = nn.Linear(d, self.heads * dk, bias=bias) if q["q_proj"] else None
        self.q_mlp, self.q_mlp_weight = None, 0.0
        if q["q_mlp"]:
            m = q["q_mlp"]
            self.q_mlp_weight = m["weight"]
            rms = _norm(config, d, "RMSNorm")
            if m["out_norm"] == "head_rms_gain":
                self.q_mlp = MLP(config, m["width"], m["activation"], rms, head_gain=True)
            else:
                self.q_mlp = MLP(config, m["width"], m["activation"], rms, _norm(config, d, "LayerNorm"))
        self.k_proj = nn.Linear(d, self.groups * dk, bias=bias)
        self.v_proj = nn.Linear(d, self.groups * dk, bias=bias)
        self.q_norm, self.k_norm = _head_norm(config), _head_norm(config)
        self.o_proj = nn.Linear(self.heads * dk, d, bias=bias)
        self.skip = nn.Linear(d, d, bias=bias) if q["skip"] else None

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if self.x_weight:
            q = self.x_weight * (head_rms(x, self.heads, self.eps) if self.x_head_rms else x)
        else:
            q = None
        for term in (
            self.q_proj(x) if self.q_proj is not None else None,
            self.q_mlp_weight * self.q_mlp(x) if self.q_mlp is not None else None,
        ):
            if term is not None:
                q = term if q is None else q + term
        return q

    def _heads(self, t: torch.Tensor, n: int) -> torch.Tensor:
        b, s, _ = t.shape
        return t.view(b, s, n, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, rope, mask, cache) -> torch.Tensor:
        if self.pre is not None:
            x = x + self.pre(x)
        q = self.q_norm(self._heads(self._query(x), self.heads))
        k = self.k_norm(self._heads(self.k_proj(x), self.groups))
        v = self._heads(self.v_proj(x), self.groups)
        if rope is not None:
            cos, sin = rope
            q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        rep = self.heads // self.groups
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        y = self.o_proj(y.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))
        return y if self.skip is None else y + self.skip(x)


class Block(nn.Module):
    def __init__(self, config: NlqConfig, layer_idx: int) -> None:
        super().__init__()
        self.ln_1 = _norm(config, config.hidden_size)
        self.attn = Attention(config, layer_idx)
        self.ln_2 = _norm(config, config.hidden_size)
        self.mlp = MoE(config) if config.num_experts else MLP(config, config.intermediate_size)

    def forward(self, x, rope, mask, cache):
        x = x + self.attn(self.ln_1(x), rope, mask, cache)
        return x + self.mlp(self.ln_2(x))


class Transformer(nn.Module):
    def __init__(self, config: NlqConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        if config.position_embedding == "learned_absolute":
            self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.h = nn.ModuleList(Block(config, i) for i in range(config.num_hidden_layers))
        self.ln_f = _norm(config, config.hidden_size)


class NlqForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = NlqConfig
    base_model_prefix = "transformer"
    _tied_weights_keys = ["lm_head.weight"]
    _no_split_modules = ["Block"]

    def __init__(self, config: NlqConfig) -> None:
        super().__init__(config)
        self.transformer = Transformer(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.transformer.wte

    def set_input_embeddings(self, value):
        self.transformer.wte = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def _rope(self, positions: torch.Tensor):
        c = self.config
        if c.position_embedding != "rope":
            return None
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim))
        emb = torch.outer(positions.float(), inv_freq.to(positions.device))
        emb = torch.cat((emb, emb), dim=-1)
        return emb.cos(), emb.sin()

    @staticmethod
    def _mask(attention_mask: torch.Tensor | None, positions: torch.Tensor) -> torch.Tensor:
        """Query i (at positions[i]) sees keys 0..positions[i], less padding keys (attention_mask 0):
        [b or 1, 1, s, past + s] booleans, True = attend."""
        keys = torch.arange(int(positions[-1]) + 1, device=positions.device)
        mask = (keys[None, :] <= positions[:, None])[None, None]
        if attention_mask is None:
            return mask
        return mask & attention_mask.bool()[:, None, None, : keys.numel()]

    def forward(
        self, input_ids=None, attention_mask=None, past_key_values=None, use_cache=None, labels=None, **_unused
    ) -> CausalLMOutputWithPast:
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache()
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        positions = torch.arange(past, past + input_ids.shape[1], device=input_ids.device)
        x = self.transformer.wte(input_ids)
        if self.config.position_embedding == "learned_absolute":
            x = x + self.transformer.wpe(positions)
        rope, mask = self._rope(positions), self._mask(attention_mask, positions)
        cache = past_key_values if use_cache else None
        for block in self.transformer.h:
            x = block(x, rope, mask, cache)
        logits = self.lm_head(self.transformer.ln_f(x) * self.config.logits_scale)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=cache)

    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, attention_mask=None, **_unused):
        """With a cache, only the tokens it does not hold yet."""
        if past_key_values is not None:
            input_ids = input_ids[:, past_key_values.get_seq_length() :]
        return {"input_ids": input_ids, "attention_mask": attention_mask, "past_key_values": past_key_values}
