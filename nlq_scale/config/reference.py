"""Render the configuration reference (docs/configuration.md) from the pydantic schemas, so the
docs cannot drift from the code: `python -m nlq_scale.config.reference > docs/configuration.md`."""

from __future__ import annotations

import re
import typing

from pydantic import BaseModel

from nlq_scale.config.schema import RunConfig

HEADER = """# Configuration reference

Generated from `nlq_scale/config/schema.py` by `python -m nlq_scale.config.reference`
(tests/test_docs.py fails when this file is stale). A run config is layered:
`configs/scales/<scale>.yaml` <- `configs/arms/<arm>.yaml` <- `--config FILE` <- `key=value`
overrides on the command line (`model.mlp_ratio=4.75`, `train.lr=1e-3`). Unknown keys are errors.

| key | type | default | meaning |
|---|---|---|---|
"""


def _type_name(annotation: object) -> str:
    text = str(annotation).replace("typing.", "").replace("<class '", "").replace("'>", "")
    text = text.replace("nlq_scale.config.schema.", "")
    text = re.sub(r"Annotated\[(\w+), Gt\(gt=0\)\]", r"\1 > 0", text)
    text = re.sub(r"^Optional\[(.*)\]$", r"\1 | None", text)
    return text.replace("|", "\\|")


def _submodel(annotation: object) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def rows(model: type[BaseModel], prefix: str = "") -> list[str]:
    out = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        sub = _submodel(field.annotation)
        if sub is not None:
            out += rows(sub, f"{key}.")
            continue
        for arg in typing.get_args(field.annotation):
            if _submodel(arg) is not None and arg is not type(None):
                out += rows(arg, f"{key}[].")
        default = field.default if not field.is_required() else "required"
        doc = (field.description or "").replace("|", "\\|")
        out.append(f"| `{key}` | {_type_name(field.annotation)} | `{default}` | {doc} |")
    return out


def render_markdown() -> str:
    return HEADER + "\n".join(rows(RunConfig)) + "\n"


if __name__ == "__main__":
    print(render_markdown(), end="")
