"""Readers of a HybridModel spec's fields: each checks one field's type and bounds, fills in its
default, and raises SpecError naming the field (tandem_operator.spec composes them).
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from kubernetes.utils import parse_quantity


class SpecError(ValueError):
    """The HybridModel spec is invalid; the message names the field and the rule."""


# The CRD's quantity pattern, without negative or milli values that make no sense for memory.
_QUANTITY = re.compile(
    r"^(\+)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[kMGTPE]|([eE](\+)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")


def _object(value: Any, where: str) -> Mapping:
    if not isinstance(value, Mapping):
        raise SpecError(f"{where} must be an object, got {type(value).__name__}")
    return value


def _known(raw: Mapping, where: str, cls: type) -> None:
    unknown = sorted(set(raw) - set(cls.__dataclass_fields__))
    if unknown:
        raise SpecError(f"{where} has unknown field(s): {', '.join(unknown)}")


def _required(raw: Mapping, key: str, where: str) -> Any:
    if raw.get(key) is None:
        raise SpecError(f"{where}.{key} is required")
    return raw[key]


def _value(raw: Mapping, key: str, where: str, default: Any) -> Any:
    value = raw.get(key)
    if value is None:
        if default is None:
            raise SpecError(f"{where}.{key} is required")
        return default
    return value


def _int(raw: Mapping, key: str, where: str, default: int | None, minimum: int | None = None,
         maximum: int | None = None) -> int:
    value = _value(raw, key, where, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{where}.{key} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise SpecError(f"{where}.{key} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise SpecError(f"{where}.{key} must be <= {maximum}, got {value}")
    return value


def _number(raw: Mapping, key: str, where: str, default: float | None) -> float:
    value = _value(raw, key, where, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecError(f"{where}.{key} must be a number, got {value!r}")
    return value


def _bool(raw: Mapping, key: str, where: str, default: bool) -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise SpecError(f"{where}.{key} must be true or false, got {value!r}")
    return value


def _string(raw: Mapping, key: str, where: str, default: str | None, min_length: int = 0) -> str:
    value = raw.get(key, default)
    if value is None:
        raise SpecError(f"{where}.{key} is required")
    if not isinstance(value, str) or len(value) < min_length:
        raise SpecError(f"{where}.{key} must be a non-empty string, got {value!r}")
    return value


def _choice(raw: Mapping, key: str, where: str, default: str, choices: tuple) -> str:
    value = raw.get(key, default)
    if value not in choices:
        raise SpecError(f"{where}.{key} must be one of {', '.join(choices)}; got {value!r}")
    return value


def _quantity(raw: Mapping, key: str, where: str, default: str) -> str:
    value = raw.get(key, default)
    try:
        if not isinstance(value, str) or not _QUANTITY.match(value) or parse_quantity(value) <= 0:
            raise ValueError(value)
    except ValueError:
        raise SpecError(f"{where}.{key} must be a positive quantity such as 32Gi, got {value!r}") from None
    return value
