"""The building blocks of the `dtrain` config's sections (`distributed_training.config`): the error
every rule raises, strict field types that still read scientific notation, the base class of a
section, and `given`, which tells a choice from a default.

Validation is strict (a value of the wrong type is an error, never coerced: ``"no"`` is not a
boolean, ``5`` is not a path), but YAML 1.1 reads ``1e-3`` as a string and users write ``1e4`` for
an integer: `Int`, `Float`, `PositiveInt` and `PositiveFloat` accept both.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

__all__ = ["ConfigError", "Int", "Float", "PositiveInt", "PositiveFloat", "PathStr", "Section", "given"]


class ConfigError(ValueError):
    """A configuration field is unknown or invalid; the message names it."""


# A decimal number, with or without a fraction or an exponent: what YAML 1.2 reads as a float.
_NUMBER = re.compile(r"[-+]?(?:\d[\d_]*(?:\.[\d_]*)?|\.\d[\d_]*)(?:[eE][-+]?\d+)?")


def _number(value: Any) -> Any:
    """Numbers written as text (``"3e-4"``: YAML 1.1 has no float without a dot) become floats."""
    if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        return float(value.replace("_", ""))
    return value


def _whole(value: Any) -> Any:
    """``1e4`` or ``"1e4"`` where an integer is expected: the integer, when it has no fraction."""
    value = _number(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# Strict types (no bool for a number, no number for a string) that still take scientific notation.
Int = Annotated[int, BeforeValidator(_whole)]
Float = Annotated[float, BeforeValidator(_number)]
PositiveInt = Annotated[int, Field(ge=1), BeforeValidator(_whole)]
PositiveFloat = Annotated[float, Field(gt=0), BeforeValidator(_number)]
PathStr = Annotated[str, Field(min_length=1)]


def given(section: BaseModel, name: str) -> bool:
    """Whether field `name` of `section` was set to something other than its default. A config written by
    ``--print-config`` spells every default out; only a value that differs is a choice that can
    disagree with another field."""
    return name in section.model_fields_set and getattr(section, name) != type(section).model_fields[name].get_default(
        call_default_factory=True)


class Section(BaseModel):
    """A section of the config: strict, no unknown field, each field's docstring its description."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, use_attribute_docstrings=True)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump()
