"""What a query arm is: one object that decides everything about its query path.

An arm module defines one `Arm` subclass and the registry (`nlq_scale.arms`) registers it. Every
method below is abstract or has a default that is right for most arms, and `register` refuses an
arm with a missing piece, so a new arm fails at import (and in tests/test_arms.py), not in a run.

This module and the arms' top levels import only pydantic: the config schema derives `model.arm`
and the per-arm option sections from the registry, and config loading must stay cheap. Torch and
megatron are imported inside the methods that build modules. The methods take the resolved model
config as a `ModelShape` (nlq_scale.shape), so the arms never import the schema that imports them.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import Field, PositiveInt, model_validator

from nlq_scale.shape import ModelShape, linear_params, norm_params
from nlq_scale.strict import Activation, Strict, renamed

if TYPE_CHECKING:
    from megatron.core.transformer.spec_utils import ModuleSpec
    from torch import nn


@dataclass(frozen=True)
class WeightName:
    """One parameter of an arm's query path under its three names, relative to a layer:
    reference: in the reference model's attention (`nlq_scale.model.reference`), e.g. `query.f.up.weight`;
    megatron: in a megatron layer, e.g. `self_attention.query.f.up.weight`. A name starting with
    `self_attention.linear_qkv.` means the query rows of megatron's fused QKV projection;
    export: a flat, framework-free name for exported weights, e.g. `attn.q_mlp.up.weight`.
    matrix: a hidden weight matrix (fan-in scaled under muP-style LR transfer) rather than a vector
    (norm gain or bias)."""

    reference: str
    megatron: str
    export: str
    matrix: bool


class QueryMLPOptions(Strict):
    """Options of an arm built around an MLP d -> width -> d (the section is model.<section>)."""

    section: ClassVar[str]
    width: PositiveInt | None = Field(None, description="hidden width of the arm's MLP (d -> width -> d); default d/2")
    activation: Activation = Field("gelu", description="nonlinearity of the arm's MLP")

    @model_validator(mode="before")
    @classmethod
    def _migrate(cls, data):
        return renamed(data, "rank", "width", f"model.{cls.section}")

    def width_for(self, m: ModelShape) -> int:
        return self.width or m.hidden_size // 2


class NormedQueryMLPOptions(QueryMLPOptions):
    """Options of an arm whose MLP reads RMSNorm(x) (f = W2 act(W1 RMSNorm x))."""

    fuse_up: bool = Field(
        False,
        description="fold the RMSNorm into W1's GEMM (its gain into W1 at each step, 1/rms(x) after the "
        "GEMM): the same parameters and function, the normalized x never written",
    )


def query_width(m: ModelShape) -> int:
    return m.num_attention_heads * m.head_dim


def export_recipe(
    x: float = 0.0,
    q_proj: bool = False,
    q_mlp: dict | None = None,
    pre: dict | None = None,
    skip: bool = False,
    x_head_rms: bool = False,
) -> dict:
    """An `Arm.export_query` value with every key present."""
    return {"x": x, "x_head_rms": x_head_rms, "q_proj": q_proj, "q_mlp": q_mlp, "pre": pre, "skip": skip}


def linear_names(m: ModelShape, reference: str, megatron: str, export: str) -> list[WeightName]:
    """A linear layer's weight (and bias with model.add_bias_linear) under its three names."""
    names = [WeightName(f"{reference}.weight", f"{megatron}.weight", f"{export}.weight", True)]
    if m.add_bias_linear:
        names.append(WeightName(f"{reference}.bias", f"{megatron}.bias", f"{export}.bias", False))
    return names


def norm_names(m: ModelShape, reference: str, megatron: str, export: str, kind: str) -> list[WeightName]:
    """A norm's gain (and bias for a LayerNorm with model.norm_bias) under its three names."""
    params = ("weight", "bias") if kind == "LayerNorm" and m.norm_bias else ("weight",)
    return [WeightName(f"{reference}.{p}", f"{megatron}.{p}", f"{export}.{p}", False) for p in params]


class Arm(ABC):
    """One query arm. Class attributes describe it; methods take the (resolved) ModelConfig."""

    name: ClassVar[str]
    summary: ClassVar[str]  # one line: what q is
    # The arm's option section `model.<options_key>` (None: the arm has no options).
    options: ClassVar[type[Strict] | None] = None
    options_key: ClassVar[str | None] = None
    # The arm every other is compared against (analysis defaults, the parameter-matched control).
    baseline: ClassVar[bool] = False
    # True when megatron's fused QKV projection carries the query (the stock attention, TP via its
    # column-parallel split); False when the arm's own query module does and K/V come from `linear_kv`.
    fused_qkv: ClassVar[bool]
    # The query is added to or replaces the residual stream, so heads x head_dim must equal d.
    query_is_hidden_width: ClassVar[bool] = False
    # Megatron sequence parallelism works: the query module takes this rank's sequence shard and
    # returns its heads over the whole sequence (model.query.to_local_heads), marking its norms
    # (model.query.on_sequence_shard).
    sequence_parallel: ClassVar[bool] = False
    # False where megatron's Transformer Engine spec cannot express the arm (e.g. TE fuses the block's
    # input norm into linear_qkv, so an arm that reshapes x between that norm and Q/K/V cannot use it).
    transformer_engine: ClassVar[bool] = True
    # The query mode of the nonlinear-query authors' nanoGPT (bias=False) that this arm is with
    # model.norm_bias=false, at the same attention (None: none is).
    nanogpt_mode: ClassVar[str | None] = None

    def settings(self, m: ModelShape) -> Any:
        """This arm's option section of the model config."""
        return getattr(m, self.options_key) if self.options_key else None

    def check(self, m: ModelShape) -> None:
        """Raise ValueError (one line) when the model shape does not fit the arm."""
        if m.transformer_impl == "transformer_engine" and not self.transformer_engine:
            raise ValueError(
                f"arm {self.name} cannot be built from the Transformer Engine spec: use model.transformer_impl=local"
            )
        if self.query_is_hidden_width and query_width(m) != m.hidden_size:
            raise ValueError(
                f"arm {self.name} needs query width == hidden_size, got heads*kv_channels = "
                f"{query_width(m)} != {m.hidden_size}"
            )

    @abstractmethod
    def softmax_scale(self, m: ModelShape) -> float:
        """The default attention scale (model.softmax_scale overrides it)."""

    # ------------------------------------------------------------------ accounting

    @abstractmethod
    def query_params(self, m: ModelShape) -> dict[str, int]:
        """Parameters of the query path per layer, by component (K/V/output projections excluded).
        Names containing "norm" are replicated across tensor-parallel ranks, the rest split."""

    def query_flops(self, m: ModelShape) -> int:
        """Training FLOPs per token per layer of the query path: 6 x its parameters (forward 2, backward 4)."""
        return 6 * sum(self.query_params(m).values())

    @abstractmethod
    def activation_elements(self, m: ModelShape, tokens: int) -> tuple[float, float]:
        """Elements the query path keeps for backward per layer beyond the stock attention's
        (which already holds q, k, v and the context), for `tokens` = s x b tokens:
        (replicated on every tensor-parallel rank, split across them)."""

    def recomputed_activation_elements(self, m: ModelShape, tokens: int) -> tuple[float, float] | None:
        """What the query path keeps for backward (as `activation_elements`) when
        parallel.recompute_query frees its inner activations and recomputes them in backward, for
        arms whose query path has an MLP to recompute; None: nothing to recompute (the option does
        not change the arm)."""
        return None

    def recomputes_query(self, m: ModelShape, requested: bool) -> bool:
        """Whether the built modules recompute the query path (parallel.recompute_query = requested)."""
        return requested and self.recomputed_activation_elements(m, 1) is not None

    # ------------------------------------------------------------------ modules

    @abstractmethod
    def megatron_attention(self, m: ModelShape, stock: ModuleSpec, column_linear: type) -> ModuleSpec:
        """The layer's `self_attention` spec, given megatron's stock one (its q/k norms already set
        per model.qk_norm) and the backend's column-parallel linear (for a `linear_kv`)."""

    @abstractmethod
    def reference_query(self, m: ModelShape) -> nn.Module:
        """The plain-PyTorch query path: forward(x [b, s, d]) -> q [b, s, heads * head_dim]. It may
        also define prepare(x) -> x (what Q/K/V see) and finish(x, y) -> y (after the output projection)."""

    @abstractmethod
    def weight_names(self, m: ModelShape) -> list[WeightName]:
        """Every parameter of the query path (reference <-> megatron <-> export)."""

    def export_query(self, m: ModelShape) -> dict | None:
        """How the exported model (nlq_scale.export) composes this arm's query path from the modules
        its `weight_names` export names hold, as plain JSON for the exported config (`export_recipe`):
        - x: weight of x in q (x_head_rms: of x divided by each head's RMS);
        - q_proj: add attn.q_proj(x);
        - q_mlp {weight, width, activation, out_norm}: add weight * norm_out(down(act(up(norm_in x))))
          from attn.q_mlp (out_norm "layernorm"; "head_rms_gain": head_norm_gain times the per-head
          RMS-normed value instead);
        - pre {width, activation}: Q/K/V see x + down(act(up(norm x))) from attn.pre;
        - skip: add attn.skip(that input) to the attention output.
        None: the arm cannot be exported."""
        return None

    def nanogpt_names(self, m: ModelShape) -> dict[str, str]:
        """The nonlinear-query authors' nanoGPT attention parameters of this arm's query path, by
        their name within the attention -> our `WeightName.export` name (see `nanogpt_mode`); "c_attn.q"
        means the query rows of their fused c_attn."""
        return {}


def inverse_sqrt_head_dim(m: ModelShape) -> float:
    return 1.0 / math.sqrt(m.head_dim)


class MLPArm(Arm):
    """An arm whose query path holds an MLP d -> width -> d (options: a `QueryMLPOptions`), at the
    stock attention scale."""

    def width(self, m: ModelShape) -> int:
        return self.settings(m).width_for(m)

    def softmax_scale(self, m: ModelShape) -> float:
        return inverse_sqrt_head_dim(m)

    def query_mlp_params(self, m: ModelShape) -> dict[str, int]:
        """The query MLP's accounting: RMSNorm (d) -> W1 (d -> width) -> act -> W2 (width -> d)."""
        d, r = m.hidden_size, self.width(m)
        return {"nlq_rmsnorm": norm_params(m, d, "RMSNorm"), "nlq_w1": linear_params(m, d, r),
                "nlq_w2": linear_params(m, r, d)}

    def normed_mlp_elements(self, m: ModelShape, tokens: int) -> tuple[float, float]:
        """What act(W1 RMSNorm x) keeps for backward up to W2's input (`activation_elements`):
        the RMSNorm output (full vectors), W1's and the activation's outputs (split); with fuse_up
        no normalized x, but W1's GEMM output and it over rms(x) (split)."""
        if self.settings(m).fuse_up:
            return 0.0, tokens * 3 * self.width(m)
        return tokens * m.hidden_size, tokens * 2 * self.width(m)


REQUIRED_ATTRIBUTES = ("name", "summary", "fused_qkv")


def validate_arm(arm: type[Arm]) -> None:
    """Refuse an arm that leaves out a piece (abstract method, attribute, or a half-declared option section)."""
    missing = sorted(getattr(arm, "__abstractmethods__", ()))
    missing += [a for a in REQUIRED_ATTRIBUTES if not hasattr(arm, a)]
    if missing:
        raise TypeError(f"arm {getattr(arm, 'name', arm.__name__)} does not provide: {', '.join(missing)}")
    if (arm.options is None) != (arm.options_key is None):
        raise TypeError(f"arm {arm.name}: set both `options` and `options_key`, or neither")
