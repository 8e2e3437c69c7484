"""What the query arms and the parameter accounting read from a model config, and the parameter
counts they share. The config schema imports both (it derives `model.arm` from the arm registry and
solves a parameter-matched MLP width with the accounting), so they take its ModelConfig as a
`ModelShape` and this module imports nothing of the package."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


class MoEShape(Protocol):
    num_experts: int | None
    router_topk: int


# runtime_checkable so that tests/test_config.py can check that ModelConfig still has every field named here.
@runtime_checkable
class ModelShape(Protocol):
    """The fields of nlq_scale.config.schema.ModelConfig that the arms and the accounting read. An
    arm reads its option section `model.<options_key>` by name (Arm.settings)."""

    arm: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    mlp_ratio: float
    ffn_hidden_size: int | None
    match_params_of: str | None
    seq_length: int
    position_embedding: str
    tie_embeddings: bool
    add_bias_linear: bool
    normalization: str
    norm_bias: bool
    qk_norm: str
    moe: MoEShape
    transformer_impl: str

    @property
    def head_dim(self) -> int: ...

    @property
    def query_groups(self) -> int: ...

    @property
    def padded_vocab_size(self) -> int: ...

    def model_copy(self, *, update: dict[str, Any]) -> ModelShape: ...


def linear_params(m: ModelShape, fan_in: int, fan_out: int) -> int:
    return fan_in * fan_out + (fan_out if m.add_bias_linear else 0)


def norm_params(m: ModelShape, width: int, kind: str | None = None) -> int:
    """A LayerNorm has a gain and (unless model.norm_bias=false) a bias; an RMSNorm has a gain."""
    kind = kind or m.normalization
    return width * (2 if kind == "LayerNorm" and m.norm_bias else 1)
