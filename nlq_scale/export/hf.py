"""The harness model as a Hugging Face `transformers` directory.

Weights are first named as in `modeling_nlq.NlqForCausalLM` (every arm: the arm's own query weights
under their `WeightName.export` names, the rest of the block fixed here). Where the arm's query is
the plain q = x W_Q and the shape fits a stock class, they are renamed for it instead:
GPT-2 (learned positions, LayerNorm, one K/V head per query head) or Arcee (RoPE, RMSNorm, any
GQA; Llama's attention with a non-gated MLP, as here). Either way the model is built in
transformers and loaded strictly before it is saved, so a name that does not fit fails the export.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import Tensor

from nlq_scale import arms
from nlq_scale.arms.base import export_recipe
from nlq_scale.config.schema import ModelConfig
from nlq_scale.errors import UsageError
from nlq_scale.model import mup
from nlq_scale.model.accounting import ffn_hidden_size
from nlq_scale.model.gpt import softmax_scale

EPS = 1e-5  # the harness's norm epsilon (nlq_scale.model.gpt.transformer_config)
PROVENANCE = "nlq_export.json"


def _split(t: Tensor, groups: int, widths: list[int]) -> list[Tensor]:
    """megatron's per-group row layout ([q_g | k_g | v_g] or [k_g | v_g]) back into whole tensors."""
    parts = t.view(groups, sum(widths), *t.shape[1:]).split(widths, dim=1)
    return [p.reshape(-1, *t.shape[1:]) for p in parts]


class _Taker:
    """Megatron tensors, each to be used exactly once: what is left over is a name nobody mapped."""

    def __init__(self, state: dict[str, Tensor]) -> None:
        self.state = {k: v.detach().float().clone() for k, v in state.items() if not k.endswith("_extra_state")}

    def take(self, name: str) -> Tensor:
        return self.state.pop(name)

    def module(self, src: str, dst: str, out: dict[str, Tensor]) -> None:
        """A module's weight and (when it has one) bias."""
        for p in ("weight", "bias"):
            if f"{src}.{p}" in self.state:
                out[f"{dst}.{p}"] = self.take(f"{src}.{p}")


def nlq_state(state: dict[str, Tensor], m: ModelConfig) -> dict[str, Tensor]:
    """A TP=1 megatron GPT's state dict under NlqForCausalLM's names."""
    arm, src, out = arms.get(m.arm), _Taker(state), {}
    out["transformer.wte.weight"] = src.take("embedding.word_embeddings.weight")
    if m.position_embedding == "learned_absolute":
        out["transformer.wpe.weight"] = src.take("embedding.position_embeddings.weight")
    g, dk = m.query_groups, m.head_dim
    for i in range(m.num_layers):
        p, h = f"decoder.layers.{i}.", f"transformer.h.{i}."
        src.module(p + "input_layernorm", h + "ln_1", out)
        src.module(p + "pre_mlp_layernorm", h + "ln_2", out)
        src.module(p + "mlp.linear_fc1", h + "mlp.up", out)
        src.module(p + "mlp.linear_fc2", h + "mlp.down", out)
        src.module(p + "mlp.router", h + "mlp.router", out)
        for e in range(m.moe.num_experts or 0):
            src.module(f"{p}mlp.experts.local_experts.{e}.linear_fc1", f"{h}mlp.experts.{e}.up", out)
            src.module(f"{p}mlp.experts.local_experts.{e}.linear_fc2", f"{h}mlp.experts.{e}.down", out)
        src.module(p + "self_attention.linear_proj", h + "attn.o_proj", out)
        src.module(p + "self_attention.q_layernorm", h + "attn.q_norm", out)
        src.module(p + "self_attention.k_layernorm", h + "attn.k_norm", out)
        query_rows = {}
        for kind in ("weight", "bias") if m.add_bias_linear else ("weight",):
            if arm.fused_qkv:
                rep = m.num_attention_heads // g
                q, k, v = _split(src.take(f"{p}self_attention.linear_qkv.{kind}"), g, [rep * dk, dk, dk])
                query_rows[f"self_attention.linear_qkv.{kind}"] = q
            else:
                k, v = _split(src.take(f"{p}self_attention.linear_kv.{kind}"), g, [dk, dk])
            out[f"{h}attn.k_proj.{kind}"], out[f"{h}attn.v_proj.{kind}"] = k, v
        for w in arm.weight_names(m):
            out[h + w.export] = query_rows.pop(w.megatron) if w.megatron in query_rows else src.take(p + w.megatron)
    src.module("decoder.final_layernorm", "transformer.ln_f", out)
    out["lm_head.weight"] = out["transformer.wte.weight"] if m.tie_embeddings else src.take("output_layer.weight")
    if src.state:
        raise ValueError(f"export: no name for {sorted(src.state)[0]} (arm {m.arm}: check its weight_names)")
    return out


def _plain_linear_query(m: ModelConfig) -> bool:
    """The query is q = x W_Q under a 1/sqrt(d_k) scale, no QK-norm and unscaled logits: what stock classes compute."""
    return (
        arms.get(m.arm).export_query(m) == export_recipe(q_proj=True)
        and m.qk_norm == "none"
        and math.isclose(softmax_scale(m), m.head_dim**-0.5, rel_tol=1e-12)
        and mup.output_multiplier(m) == 1.0
    )


def stock_class(m: ModelConfig) -> str | None:
    """"gpt2", "arcee", or None (the exported modeling code; MoE models too: no stock class has
    megatron's non-gated experts)."""
    if not _plain_linear_query(m) or m.moe.num_experts:
        return None
    if (
        m.position_embedding == "learned_absolute"
        and m.normalization == "LayerNorm"
        and m.query_groups == m.num_attention_heads
        and m.num_attention_heads * m.head_dim == m.hidden_size
    ):
        return "gpt2"
    if m.position_embedding == "rope" and m.normalization == "RMSNorm":
        return "arcee"
    return None


def _common(m: ModelConfig) -> dict:
    from nlq_scale.data.tokenizer import EOT_ID

    return {
        "vocab_size": m.padded_vocab_size,
        "tie_word_embeddings": m.tie_embeddings,
        "bos_token_id": EOT_ID,
        "eos_token_id": EOT_ID,
        "torch_dtype": "float32",
    }


def _gpt2(m: ModelConfig, s: dict[str, Tensor]):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_embd=m.hidden_size, n_layer=m.num_layers, n_head=m.num_attention_heads, n_positions=m.seq_length,
        n_inner=ffn_hidden_size(m), activation_function="gelu", layer_norm_epsilon=EPS,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **_common(m),
    )  # fmt: skip
    out = {"transformer.wte.weight": s["transformer.wte.weight"], "transformer.wpe.weight": s["transformer.wpe.weight"]}

    def conv1d(dst: str, weight: Tensor, bias: Tensor | None) -> None:
        # GPT-2's Conv1D stores W transposed, and always has a bias (zero where the harness has none).
        out[f"{dst}.weight"] = weight.t().contiguous()
        out[f"{dst}.bias"] = bias if bias is not None else torch.zeros(weight.shape[0])

    def norm(dst: str, src: str) -> None:
        out[f"{dst}.weight"] = s[f"{src}.weight"]
        out[f"{dst}.bias"] = s.get(f"{src}.bias", torch.zeros_like(s[f"{src}.weight"]))

    for i in range(m.num_layers):
        h = f"transformer.h.{i}."
        norm(h + "ln_1", h + "ln_1")
        norm(h + "ln_2", h + "ln_2")
        qkv = [f"{h}attn.{x}_proj" for x in "qkv"]
        biases = [s.get(f"{n}.bias") for n in qkv]
        conv1d(
            h + "attn.c_attn",
            torch.cat([s[f"{n}.weight"] for n in qkv]),
            torch.cat(biases) if m.add_bias_linear else None,
        )
        conv1d(h + "attn.c_proj", s[f"{h}attn.o_proj.weight"], s.get(f"{h}attn.o_proj.bias"))
        conv1d(h + "mlp.c_fc", s[f"{h}mlp.up.weight"], s.get(f"{h}mlp.up.bias"))
        conv1d(h + "mlp.c_proj", s[f"{h}mlp.down.weight"], s.get(f"{h}mlp.down.bias"))
    norm("transformer.ln_f", "transformer.ln_f")
    out["lm_head.weight"] = s["lm_head.weight"]
    return GPT2LMHeadModel(config), out


def _arcee(m: ModelConfig, s: dict[str, Tensor]):
    from transformers import ArceeConfig, ArceeForCausalLM

    config = ArceeConfig(
        hidden_size=m.hidden_size, intermediate_size=ffn_hidden_size(m), num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads, num_key_value_heads=m.query_groups, head_dim=m.head_dim,
        hidden_act="gelu", max_position_embeddings=m.seq_length, rms_norm_eps=EPS, rope_theta=float(m.rotary_base),
        attention_bias=m.add_bias_linear, mlp_bias=m.add_bias_linear, **_common(m),
    )  # fmt: skip
    rename = {"ln_1": "input_layernorm", "ln_2": "post_attention_layernorm", "attn.o_proj": "self_attn.o_proj",
              "mlp.up": "mlp.up_proj", "mlp.down": "mlp.down_proj"}  # fmt: skip
    rename |= {f"attn.{x}_proj": f"self_attn.{x}_proj" for x in "qkv"}
    out = {"model.embed_tokens.weight": s["transformer.wte.weight"], "lm_head.weight": s["lm_head.weight"]}
    out["model.norm.weight"] = s["transformer.ln_f.weight"]
    for name, t in s.items():
        if name.startswith("transformer.h."):
            _, _, i, rest = name.split(".", 3)
            module, _, kind = rest.rpartition(".")
            out[f"model.layers.{i}.{rename[module]}.{kind}"] = t
    return ArceeForCausalLM(config), out


def _nlq(m: ModelConfig, s: dict[str, Tensor]):
    from nlq_scale.export.modeling_nlq import NlqConfig, NlqForCausalLM

    NlqConfig.register_for_auto_class()
    NlqForCausalLM.register_for_auto_class("AutoModelForCausalLM")
    config = NlqConfig(
        hidden_size=m.hidden_size, num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.query_groups, head_dim=m.head_dim, intermediate_size=ffn_hidden_size(m),
        max_position_embeddings=m.seq_length, position_embedding=m.position_embedding,
        rope_theta=float(m.rotary_base), normalization=m.normalization, norm_bias=m.norm_bias, norm_eps=EPS,
        qk_norm=m.qk_norm, bias=m.add_bias_linear, softmax_scale=softmax_scale(m),
        logits_scale=mup.output_multiplier(m),
        query=arms.get(m.arm).export_query(m), num_experts=m.moe.num_experts, router_topk=m.moe.router_topk,
        **_common(m),
    )  # fmt: skip
    return NlqForCausalLM(config), s


BUILDERS = {"gpt2": _gpt2, "arcee": _arcee, None: _nlq}


def hf_model(state: dict[str, Tensor], m: ModelConfig, stock: bool = True):
    """The transformers model holding these weights (fp32, eval mode); `stock=False`: NlqForCausalLM
    even where a stock class fits (one implementation for every arm, as benchmarks/decode.py wants)."""
    if arms.get(m.arm).export_query(m) is None:
        raise UsageError(f"model.arm: arm {m.arm} declares no export_query, so it cannot be exported")
    model, weights = BUILDERS[stock_class(m) if stock else None](m, nlq_state(state, m))
    model.load_state_dict(weights, strict=True)
    return model.float().eval()


def write_tokenizer(out: Path, seq_length: int) -> None:
    """GPT-2's tokenizer files from the BPE files the harness tokenizes with (tiktoken's encoder.json
    and vocab.bpe are GPT-2's vocab.json and merges.txt)."""
    from transformers import GPT2TokenizerFast

    from nlq_scale.data.tokenizer import EOT_TEXT, tokenizer_files

    files = tokenizer_files()
    tokenizer = GPT2TokenizerFast(
        vocab_file=str(files["encoder.json"]), merges_file=str(files["vocab.bpe"]),
        bos_token=EOT_TEXT, eos_token=EOT_TEXT, unk_token=EOT_TEXT, model_max_length=seq_length,
    )  # fmt: skip
    tokenizer.save_pretrained(out)


def write_export(model, out: Path, m: ModelConfig, provenance: dict) -> None:
    model.save_pretrained(out, safe_serialization=True)
    write_tokenizer(out, m.seq_length)
    (out / PROVENANCE).write_text(json.dumps(provenance, indent=2) + "\n")


def export_checkpoint(ckpt, out: Path):
    """A run's checkpoint (`export.checkpoint.find_checkpoint`) written as a transformers directory
    into `out`; returns the transformers model."""
    from nlq_scale.config.schema import ParallelConfig
    from nlq_scale.export.checkpoint import load_harness_model
    from nlq_scale.runtime.dist import distributed

    with distributed(ParallelConfig(), device="cpu"):
        state = load_harness_model(ckpt).state_dict()
    model = hf_model(state, ckpt.cfg.model)
    provenance = {"run_dir": str(ckpt.run_dir.resolve()), "step": ckpt.step, "arm": ckpt.cfg.model.arm,
                  "engine": ckpt.cfg.train.engine, "class": type(model).__name__}  # fmt: skip
    write_export(model, out, ckpt.cfg.model, provenance)
    return model
