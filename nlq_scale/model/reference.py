"""A plain-PyTorch GPT (nanoGPT style) with any registered arm's reference query path.

It is the yardstick for the megatron-core model: tests copy its weights into the megatron model at
any tensor/pipeline layout (`load_into_megatron`, through each arm's weight names) and require the
same logits and loss.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from nlq_scale import arms
from nlq_scale.config.schema import ModelConfig
from nlq_scale.model import mup
from nlq_scale.model.accounting import ffn_hidden_size
from nlq_scale.model.gpt import softmax_scale
from nlq_scale.model.norms import HeadRMSNorm
from nlq_scale.model.query import EPS, MLP, recomputed


def _norm(m: ModelConfig, width: int) -> nn.Module:
    if m.normalization == "LayerNorm":
        return nn.LayerNorm(width, eps=EPS, bias=m.norm_bias)
    return nn.RMSNorm(width, eps=EPS)


def _head_norm(m: ModelConfig) -> nn.Module:
    return {"none": nn.Identity, "learned": lambda: _norm(m, m.head_dim), "rms": HeadRMSNorm}[m.qk_norm]()


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_tables(m: ModelConfig) -> tuple[Tensor, Tensor]:
    """cos/sin [seq, head_dim] for non-interleaved rotary embeddings (megatron's default)."""
    inv_freq = 1.0 / (m.rotary_base ** (torch.arange(0, m.head_dim, 2, dtype=torch.float32) / m.head_dim))
    freqs = torch.outer(torch.arange(m.seq_length, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class Attention(nn.Module):
    def __init__(self, m: ModelConfig, recompute_query: bool) -> None:
        super().__init__()
        self.recompute_query = arms.get(m.arm).recomputes_query(m, recompute_query)
        d, dk, bias = m.hidden_size, m.head_dim, m.add_bias_linear
        self.heads, self.groups, self.head_dim = m.num_attention_heads, m.query_groups, dk
        self.scale = softmax_scale(m)
        self.query = arms.get(m.arm).reference_query(m)
        self.k = nn.Linear(d, self.groups * dk, bias=bias)
        self.v = nn.Linear(d, self.groups * dk, bias=bias)
        self.q_norm, self.k_norm = _head_norm(m), _head_norm(m)
        self.proj = nn.Linear(self.heads * dk, d, bias=bias)

    def _heads(self, t: Tensor, n: int) -> Tensor:
        b, s, _ = t.shape
        return t.view(b, s, n, self.head_dim).transpose(1, 2)  # [b, n, s, dk]

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor] | None) -> Tensor:
        prepare = getattr(self.query, "prepare", None)
        if prepare is not None:
            x = recomputed(prepare, x, self.recompute_query)
        q = self.q_norm(self._heads(recomputed(self.query, x, self.recompute_query), self.heads))
        k = self.k_norm(self._heads(self.k(x), self.groups))
        v = self._heads(self.v(x), self.groups)
        if rope is not None:
            cos, sin = (t[: x.shape[1]] for t in rope)
            q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        rep = self.heads // self.groups
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        y = self.proj(y.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))
        finish = getattr(self.query, "finish", None)
        return y if finish is None else finish(x, y)


class Block(nn.Module):
    def __init__(self, m: ModelConfig, recompute_query: bool) -> None:
        super().__init__()
        self.ln1 = _norm(m, m.hidden_size)
        self.attn = Attention(m, recompute_query)
        self.ln2 = _norm(m, m.hidden_size)
        self.mlp = MLP(m.hidden_size, ffn_hidden_size(m), m.add_bias_linear)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor] | None) -> Tensor:
        x = x + self.attn(self.ln1(x), rope)
        return x + self.mlp(self.ln2(x))


class ReferenceGPT(nn.Module):
    """recompute_query: as parallel.recompute_query (the same function; less activation memory)."""

    def __init__(self, m: ModelConfig, recompute_query: bool = False) -> None:
        super().__init__()
        if m.moe.num_experts:
            raise ValueError("the reference model has no MoE")
        self.config = m
        self.wte = nn.Embedding(m.padded_vocab_size, m.hidden_size)
        self.wpe = nn.Embedding(m.seq_length, m.hidden_size) if m.position_embedding == "learned_absolute" else None
        self.blocks = nn.ModuleList(Block(m, recompute_query) for _ in range(m.num_layers))
        self.ln_f = _norm(m, m.hidden_size)
        self.lm_head = None if m.tie_embeddings else nn.Linear(m.hidden_size, m.padded_vocab_size, bias=False)
        self._rope = rope_tables(m) if m.position_embedding == "rope" else None
        self.output_multiplier = mup.output_multiplier(m)  # muP's logit multiplier (its init: the megatron model's)
        self._init_weights(m)

    def _init_weights(self, m: ModelConfig) -> None:
        """GPT-2 init: N(0, std) everywhere, output projections scaled by 1/sqrt(2 layers)."""
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue
            std = m.init_std
            if name.endswith(("attn.proj.weight", "mlp.down.weight")):
                std /= math.sqrt(2 * m.num_layers)
            nn.init.normal_(p, 0.0, std)
        for mod in self.modules():
            if isinstance(mod, nn.Linear) and mod.bias is not None:
                nn.init.zeros_(mod.bias)
            if hasattr(mod, "init_arm_weights"):  # an arm's own init (e.g. preproj's near-zero skip)
                mod.init_arm_weights()

    def forward(self, tokens: Tensor, labels: Tensor | None = None) -> Tensor:
        """Logits [b, s, vocab], or the per-token loss [b, s] when labels are given."""
        x = self.wte(tokens)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x, self._rope)
        x = self.ln_f(x) * self.output_multiplier
        logits = x @ (self.wte.weight if self.lm_head is None else self.lm_head.weight).t()
        if labels is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="none").view_as(labels)


def _fused_qkv(q: Tensor, k: Tensor, v: Tensor, groups: int) -> Tensor:
    """megatron's linear_qkv layout: per query group, its query heads, then its key, then its value."""
    return torch.cat([t.view(groups, -1, *t.shape[1:]) for t in (q, k, v)], dim=1).flatten(0, 1)


def _kv(k: Tensor, v: Tensor, groups: int) -> Tensor:
    """Our linear_kv layout: per query group, [k_g | v_g]."""
    return torch.cat([t.view(groups, -1, *t.shape[1:]) for t in (k, v)], dim=1).flatten(0, 1)


def _layer_state(ref: ReferenceGPT, i: int) -> dict[str, Tensor]:
    m, blk = ref.config, ref.blocks[i]
    a, g = blk.attn, m.query_groups
    arm = arms.get(m.arm)
    out = {}

    def put(name: str, mod: nn.Module) -> None:
        for pname, p in mod.named_parameters(recurse=False):
            out[f"{name}.{pname}"] = p.detach()

    put("input_layernorm", blk.ln1)
    put("pre_mlp_layernorm", blk.ln2)
    put("mlp.linear_fc1", blk.mlp.up)
    put("mlp.linear_fc2", blk.mlp.down)
    put("self_attention.linear_proj", a.proj)
    put("self_attention.q_layernorm", a.q_norm)
    put("self_attention.k_layernorm", a.k_norm)
    attention = dict(a.named_parameters())
    for w in arm.weight_names(m):
        out[w.megatron] = attention[w.reference].detach()
    fused = "self_attention.linear_qkv"
    for pname in ("weight", "bias") if m.add_bias_linear else ("weight",):
        k, v = getattr(a.k, pname).detach(), getattr(a.v, pname).detach()
        if arm.fused_qkv:
            out[f"{fused}.{pname}"] = _fused_qkv(out[f"{fused}.{pname}"], k, v, g)
        else:
            out[f"self_attention.linear_kv.{pname}"] = _kv(k, v, g)
    return out


def megatron_state(ref: ReferenceGPT) -> dict[str, Tensor]:
    """Full (unsharded) megatron GPTModel parameters named as in a 1-stage model."""
    state = {"embedding.word_embeddings.weight": ref.wte.weight.detach()}
    if ref.wpe is not None:
        state["embedding.position_embeddings.weight"] = ref.wpe.weight.detach()
    for i in range(len(ref.blocks)):
        state |= {f"decoder.layers.{i}.{k}": v for k, v in _layer_state(ref, i).items()}
    for pname, p in ref.ln_f.named_parameters():
        state[f"decoder.final_layernorm.{pname}"] = p.detach()
    head = ref.wte if ref.lm_head is None else ref.lm_head
    state["output_layer.weight"] = head.weight.detach()
    return state


def _global_name(model: nn.Module, name: str) -> str:
    """decoder.layers.<local>.x -> decoder.layers.<global>.x (pipeline stages number layers locally)."""
    if not name.startswith("decoder.layers."):
        return name
    _, _, local, rest = name.split(".", 3)
    global_index = model.decoder.layers[int(local)].layer_number - 1
    return f"decoder.layers.{global_index}.{rest}"


@torch.no_grad()
def load_into_megatron(model: nn.Module, ref: ReferenceGPT) -> None:
    """Copy the reference weights into this rank's shard of a megatron GPTModel (any TP/PP layout)."""
    from megatron.core import parallel_state as ps

    full = megatron_state(ref)
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    for name, param in model.named_parameters():
        src = full[_global_name(model, name)]
        if getattr(param, "tensor_model_parallel", False):
            src = src.chunk(tp, dim=param.partition_dim)[tp_rank]
        param.copy_(src)
