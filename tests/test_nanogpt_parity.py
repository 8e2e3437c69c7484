"""The nonlinear-query authors' model, exactly: their code is nanoGPT with bias=False (LayerNorms
without bias, no linear biases, learned positions, tied or untied embeddings) with four query
modes. `AuthorsGPT` below re-states its module shapes and forward pass (their CausalSelfAttention,
MLP, Block and GPT), so the test can count their parameters and run their forward pass. It also
states the per-head variant of residual_gelu that the public GPT-3 Large (760M) audit of their code
added (`per_head_norm`: anchor and correction RMS-normed per head, the correction's gain reusing the
output LayerNorm's weight, scale not halved), our `nonlinear-ph` arm.

With model.norm_bias=false our arms have their parameter counts at 124M to the parameter, and
our megatron model gives their logits on their weights."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nlq_scale import arms
from nlq_scale.config import load_run_config
from nlq_scale.model.accounting import count_parameters
from tests.conftest import TINY_MODEL
from tests.test_model import build_model

# their query mode -> our configs/arms name (all with model.norm_bias=false)
MODES = {
    "original": "linear",
    "identity": "identity-untied",
    "residual": "residual",
    "residual_gelu": "nonlinear",
    "residual_gelu-ph": "nonlinear-ph",
    "original-mlp4.75": "linear-mlp4.75",
}
OURS = ["model.norm_bias=false"]


@dataclass
class AuthorsConfig:
    n_layer: int
    num_heads: int
    n_embd: int
    block_size: int
    vocab_size: int
    mlp_hidden_size: int
    query_mode: str
    tie_weights: bool
    scale: float
    per_head_norm: bool = False


class BiasFreeLayerNorm(nn.Module):
    def __init__(self, ndim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, None, 1e-5)


def per_head_rms(t, nh: int, weight=None):
    """The audit's _ph_rms / _ph_rms_w: RMS over each head's channels (eps 1e-5), times an optional
    (C,) gain read as (nh, C // nh)."""
    B, T, C = t.shape
    t = t.view(B, T, nh, C // nh)
    t = t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-5)
    return (t if weight is None else t * weight.view(1, 1, nh, C // nh)).view(B, T, C)


class AuthorsAttention(nn.Module):
    def __init__(self, c: AuthorsConfig) -> None:
        super().__init__()
        self.c, d = c, c.n_embd
        self.c_attn = nn.Linear(d, (3 if c.query_mode in ("original", "residual") else 2) * d, bias=False)
        self.c_proj = nn.Linear(d, d, bias=False)
        if c.query_mode == "residual_gelu":
            self.residual_rmsnorm_input = nn.RMSNorm(d, eps=1e-5)
            self.residual_layernorm_output = BiasFreeLayerNorm(d)
            self.residual_in = nn.Linear(d, d // 2, bias=False)
            self.residual_out = nn.Linear(d // 2, d, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        mode, nh = self.c.query_mode, self.c.num_heads
        if mode in ("original", "residual"):
            q, k, v = self.c_attn(x).split(C, dim=2)
            if mode == "residual":
                q = x + q
        else:
            k, v = self.c_attn(x).split(C, dim=2)
            q = x
            if mode == "residual_gelu":
                f = self.residual_out(F.gelu(self.residual_in(self.residual_rmsnorm_input(x))))
                if self.c.per_head_norm:
                    q = per_head_rms(x, nh) + per_head_rms(f, nh, self.residual_layernorm_output.weight)
                else:
                    q = x + self.residual_layernorm_output(f)
        q, k, v = (t.view(B, T, nh, C // nh).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.c.scale)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class AuthorsBlock(nn.Module):
    def __init__(self, c: AuthorsConfig) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = BiasFreeLayerNorm(c.n_embd), AuthorsAttention(c), BiasFreeLayerNorm(c.n_embd)
        self.mlp = nn.ModuleDict(
            {"c_fc": nn.Linear(c.n_embd, c.mlp_hidden_size, bias=False), "c_proj": nn.Linear(c.mlp_hidden_size, c.n_embd, bias=False)}
        )

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp.c_proj(F.gelu(self.mlp.c_fc(self.ln_2(x))))


class AuthorsGPT(nn.Module):
    def __init__(self, c: AuthorsConfig) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(c.vocab_size, c.n_embd),
                "wpe": nn.Embedding(c.block_size, c.n_embd),
                "h": nn.ModuleList(AuthorsBlock(c) for _ in range(c.n_layer)),
                "ln_f": BiasFreeLayerNorm(c.n_embd),
            }
        )
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        if c.tie_weights:
            self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx):
        t = self.transformer
        x = t.wte(idx) + t.wpe(torch.arange(idx.shape[1]))
        for block in t.h:
            x = block(x)
        return self.lm_head(t.ln_f(x))


def authors_config(mode: str, n_layer: int, num_heads: int, n_embd: int, block_size: int, vocab_size: int) -> AuthorsConfig:
    query_mode, _, mlp = mode.partition("-mlp")
    per_head = query_mode.endswith("-ph")
    query_mode = query_mode.removesuffix("-ph")
    # their runs halve the scale for these modes; the audit's per-head variant does not
    halved = query_mode in ("identity", "residual_gelu") and not per_head
    return AuthorsConfig(
        n_layer, num_heads, n_embd, block_size, vocab_size, int(float(mlp or 4) * n_embd), query_mode,
        tie_weights=query_mode != "identity", scale=1 / math.sqrt(n_embd // num_heads) / (2 if halved else 1),
        per_head_norm=per_head,
    )


@pytest.mark.parametrize("mode", MODES)
def test_124m_parameter_counts_equal_the_authors(mode):
    ours = count_parameters(load_run_config("124m", MODES[mode], overrides=OURS).model).total
    with torch.device("meta"):
        theirs = AuthorsGPT(authors_config(mode, 12, 12, 768, 1024, 50304))
    assert ours == sum(p.numel() for p in theirs.parameters())


def copy_authors_weights(ref, theirs: AuthorsGPT, arm) -> None:
    """Their state into our reference model: names per the arm's weight map (their c_attn holds
    [q | k | v] or [k | v] stacked by rows)."""
    m, d = ref.config, ref.config.hidden_size
    t = theirs.transformer
    own = {
        "wte.weight": t.wte.weight, "wpe.weight": t.wpe.weight, "ln_f.weight": t.ln_f.weight,
        **({} if m.tie_embeddings else {"lm_head.weight": theirs.lm_head.weight}),
    }
    query_rows = {w.reference for w in arm.weight_names(m) if w.export == "attn.q_proj.weight"}
    for i, (block, their) in enumerate(zip(ref.blocks, t.h)):
        a, b = f"blocks.{i}.attn", f"blocks.{i}"
        rows = their.attn.c_attn.weight.split(d, dim=0)
        for name, w in zip([*(f"{a}.{q}" for q in query_rows), f"{a}.k.weight", f"{a}.v.weight"][-len(rows):], rows):
            own[name] = w
        own |= {
            f"{b}.ln1.weight": their.ln_1.weight, f"{b}.ln2.weight": their.ln_2.weight,
            f"{b}.mlp.up.weight": their.mlp.c_fc.weight, f"{b}.mlp.down.weight": their.mlp.c_proj.weight,
            f"{a}.proj.weight": their.attn.c_proj.weight,
        }
        if hasattr(their.attn, "residual_in"):
            own |= {
                f"{a}.query.norm_in.weight": their.attn.residual_rmsnorm_input.weight,
                f"{a}.query.f.up.weight": their.attn.residual_in.weight,
                f"{a}.query.f.down.weight": their.attn.residual_out.weight,
                f"{a}.query.{'head_norm_gain' if their.attn.c.per_head_norm else 'norm_out.weight'}":
                    their.attn.residual_layernorm_output.weight,
            }
    params = dict(ref.named_parameters())
    assert sorted(own) == sorted(params)
    with torch.no_grad():
        for name, w in own.items():
            params[name].copy_(w)


@pytest.mark.parametrize("mode", MODES)
def test_logits_equal_the_authors_on_their_weights(single_rank, mode):
    from nlq_scale.model.reference import ReferenceGPT, load_into_megatron

    cfg = load_run_config("124m", MODES[mode], overrides=[*TINY_MODEL, *OURS])
    m = cfg.model
    torch.manual_seed(0)
    theirs = AuthorsGPT(authors_config(mode, m.num_layers, m.num_attention_heads, m.hidden_size, m.seq_length, m.padded_vocab_size))
    with torch.no_grad():
        for p in theirs.parameters():  # norm gains away from 1, so a misplaced norm shows
            p.copy_(torch.randn_like(p) * (0.1 if p.dim() == 1 else 0.02) + (1.0 if p.dim() == 1 else 0.0))
    ref = ReferenceGPT(m)
    copy_authors_weights(ref, theirs, arms.get(m.arm))
    model = build_model(cfg)
    load_into_megatron(model, ref)
    tokens = torch.randint(0, m.vocab_size, (2, m.seq_length))
    positions = torch.arange(m.seq_length).unsqueeze(0).expand(2, -1)
    with torch.no_grad():
        expected = theirs(tokens)
        assert (ref(tokens) - expected).abs().max().item() <= 1e-5
        assert (model(tokens, positions, None) - expected).abs().max().item() <= 1e-5
