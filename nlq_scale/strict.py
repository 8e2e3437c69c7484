"""The strict pydantic base of every config section (the arms' option sections too); it imports only
pydantic, so the arms can use it while the config schema imports the arms."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

Activation = Literal["gelu", "relu", "relu2", "silu"]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def renamed(data: object, old: str, new: str, section: str) -> object:
    """Migration guard for a `mode="before"` validator: a renamed key set to a value is a one-line
    error naming its new key; left at null (as run directories' saved configs have it) it is dropped."""
    if isinstance(data, dict) and old in data:
        if data[old] is not None:
            raise ValueError(f"`{old}` was renamed: use {section}.{new}")
        data = {k: v for k, v in data.items() if k != old}
    return data
