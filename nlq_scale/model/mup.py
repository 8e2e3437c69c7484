"""muP (model.parametrization=mup): the rules that let a learning rate tuned at a base width transfer.

Tensor Programs V's "Table 8" form for Adam and pre-LN transformers, with the width multiplier
w = hidden_size / mup_base_hidden_size:

- hidden matrices (every weight whose fan-in grows with width: Q/K/V, the output projection, the
  MLP, MoE experts and router, and every matrix an arm declares with `WeightName.matrix`): init
  std / sqrt(w), Adam learning rate / w, Adam epsilon / w;
- vectors (norm gains and biases, the arms' norms, QK-norm gains) and embeddings (word, position,
  and an untied output layer): the base init and learning rate;
- the output logits x 1/w (so a tied embedding keeps its base init);
- weight decay independent of width: a hidden matrix's decay multiplier is w, so lr x decay per
  step equals the base model's (decoupled AdamW shrinks a weight by lr x decay each step);
- with mup_base_head_dim, the attention scale moves from 1/sqrt(d_head) towards 1/d_head:
  x sqrt(base head dim / head dim) (no change while the head dim stays at the base's).

megatron-core's own muP (TransformerConfig.use_mup, `megatron_fields`) computes the init and the
logit multiplier of the GPT it builds, ours the rest (docs/mup.md says why): the attention scale
(megatron's ignores the arm's own), the optimizer groups (by the arms' declared classes, with the
width-independent weight decay, in both engines) and the logit multiplier of the models megatron
does not build (the reference model, the export).

Under the default standard parametrization every multiplier is 1 and nothing here changes a model.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Literal

from nlq_scale import arms

if TYPE_CHECKING:
    from nlq_scale.config.schema import ModelConfig, TrainConfig

ParamClass = Literal["hidden", "vector", "embedding"]

# megatron's stock matrices whose fan-in is the width (or grows with it), by their name in a layer.
_HIDDEN = re.compile(r"(^|\.)(linear_qkv|linear_kv|linear_proj|linear_fc1|linear_fc2|router)\.weight$|\.experts\.weight[12]$")
_LAYER = re.compile(r"^decoder\.layers\.\d+\.")
_EMBEDDING = ("embedding.", "output_layer.")


def is_mup(m: ModelConfig) -> bool:
    return m.parametrization == "mup"


def width_multiplier(m: ModelConfig) -> float:
    return m.hidden_size / m.mup_base_hidden_size if is_mup(m) else 1.0


def megatron_fields(m: ModelConfig) -> dict:
    """TransformerConfig's muP fields. From them megatron computes the same w and, in the GPT it
    builds, inits the matrices of config.init_method at std / sqrt(w) (output projections at
    std / sqrt(2 L w)), the embeddings and an untied output layer at std, and multiplies the logits
    by 1/w after the output layer. Not mup_base_head_dim: the attention scale is ours (gpt.softmax_scale)."""
    if not is_mup(m):
        return {}
    return {"use_mup": True, "mup_base_hidden_size": m.mup_base_hidden_size}


def output_multiplier(m: ModelConfig) -> float:
    """What the logits are multiplied by: megatron's GPT multiplies its own (`megatron_fields`);
    this is for the models it does not build (the reference model, the export)."""
    return 1.0 / width_multiplier(m)


def attention_multiplier(m: ModelConfig) -> float:
    """What the arm's default attention scale is multiplied by. Not megatron's: it sets
    sqrt(mup_base_head_dim) / kv_channels ** mup_attn_scale_power only where softmax_scale is unset,
    which drops an arm's own default (identity's is halved), and without a base head dim its default
    power moves the scale to 1/d_head where ours leaves it (a head dim fixed while heads grow in number)."""
    if not is_mup(m) or m.mup_base_head_dim is None:
        return 1.0
    return math.sqrt(m.mup_base_head_dim / m.head_dim)


def unwrapped(name: str) -> str:
    """A parameter's name in the GPTModel, without the `module.` prefixes of DDP and Float16Module."""
    while name.startswith("module."):
        name = name[len("module.") :]
    return name


def param_class(m: ModelConfig, name: str, ndim: int) -> ParamClass:
    """The muP class of a megatron GPT parameter by its name (and dimensionality). An unknown matrix
    is an error, so a module added without a class cannot train at the wrong learning rate."""
    name = unwrapped(name)
    in_layer = _LAYER.sub("", name)
    declared = {w.megatron: w.matrix for w in arms.get(m.arm).weight_names(m)}
    if in_layer != name and in_layer in declared:
        return "hidden" if declared[in_layer] else "vector"
    if name.startswith(_EMBEDDING):
        return "embedding"
    if ndim < 2:
        return "vector"
    if _HIDDEN.search(in_layer):
        return "hidden"
    raise ValueError(f"{name}: a matrix with no muP class (declare it in its arm's weight_names or in {__name__})")


def group_multipliers(m: ModelConfig, t: TrainConfig) -> dict[ParamClass, dict[str, float]]:
    """Per class: the optimizer group's lr_mult, wd_mult and Adam eps (vectors are never decayed).
    Both engines' groups, not megatron's get_mup_config_overrides: its lr / w and eps / w are these,
    but it sets the lr as max_lr/min_lr for megatron's scheduler (the engines run train/schedule.py
    and apply lr_mult), picks the matrices by shape rather than by `param_class`, and has no wd_mult."""
    w = width_multiplier(m)
    return {
        "hidden": {"lr_mult": 1.0 / w, "wd_mult": w, "eps": t.eps / w},
        "embedding": {"lr_mult": 1.0, "wd_mult": 1.0, "eps": t.eps},
        "vector": {"lr_mult": 1.0, "wd_mult": 0.0, "eps": t.eps},
    }
