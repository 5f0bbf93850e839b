"""``--help-config``: every key of a config model with its type, default and docstring, generated
from the pydantic models (so it cannot drift from what the loader accepts)."""

from __future__ import annotations

import textwrap
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from tandem.config.load import _submodel


def _type_name(annotation: Any) -> str:
    if isinstance(annotation, type) and not typing.get_args(annotation):
        return annotation.__name__
    text = repr(annotation).replace("typing.", "").replace("pathlib.", "")
    return text.replace("NoneType", "None")


def _default(field: FieldInfo) -> str:
    if field.default is PydanticUndefined:
        return "(required)"
    if isinstance(field.default, BaseModel):
        return ""
    if isinstance(field.default, Path):
        return str(field.default)
    return repr(field.default)


def describe_config(model: type[BaseModel]) -> str:
    """One entry per key, dotted from the top (``policy.optimizer.lr``), sections in order."""
    lines: list[str] = []
    _describe(model, "", lines)
    return "\n".join(lines)


def _describe(model: type[BaseModel], prefix: str, lines: list[str]) -> None:
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        sub = _submodel(field.annotation)
        if sub is not None and typing.get_origin(field.annotation) is None:
            lines.append(f"[{key}]" + (f"  {field.description}" if field.description else ""))
            _describe(sub, f"{key}.", lines)
            continue
        lines.append(f"{key}: {_type_name(field.annotation)} = {_default(field)}")
        doc = " ".join((field.description or "").split())
        lines.extend(textwrap.wrap(doc, 96, initial_indent="    ", subsequent_indent="    "))
