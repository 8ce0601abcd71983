"""Readers of a HybridModel spec's fields: each checks one field's type and bounds, fills in its
default, and raises SpecError naming the field (tandem_operator.spec composes them). Also the
references to Secrets and ConfigMaps in the HybridModel's namespace that several fields hold.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

from kubernetes.utils import parse_quantity


class SpecError(ValueError):
    """The HybridModel spec is invalid; the message names the field and the rule."""


# Kubernetes' rules for a Secret's or ConfigMap's name (a DNS-1123 subdomain) and for the keys of its data.
_OBJECT_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
# The keys of a kubernetes.io/tls Secret (cert-manager's Certificates write them).
TLS_CERT_KEY, TLS_KEY_KEY = "tls.crt", "tls.key"
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


@dataclass(frozen=True)
class SecretRef:
    """A Secret in the HybridModel's namespace."""

    name: str


@dataclass(frozen=True)
class SecretKeyRef:
    """One key of a Secret in the HybridModel's namespace."""

    name: str
    key: str


@dataclass(frozen=True)
class ConfigMapKeyRef:
    """One key of a ConfigMap in the HybridModel's namespace."""

    name: str
    key: str


def _secret(raw: Any, where: str) -> SecretRef:
    ref = _object(raw, where)
    _known(ref, where, SecretRef)
    return SecretRef(_object_name(ref, where, "Secret"))


def _key_ref(raw: Any, where: str, kind: type[SecretKeyRef] | type[ConfigMapKeyRef], default_key: str | None = None):
    """A SecretKeyRef or ConfigMapKeyRef: a name and a key, each as Kubernetes allows them."""
    ref = _object(raw, where)
    _known(ref, where, kind)
    noun = "Secret" if kind is SecretKeyRef else "ConfigMap"
    key = _string(ref, "key", where, default_key, 1)
    if len(key) > 253 or not _KEY.match(key):
        raise SpecError(f"{where}.key {key!r} must be a {noun}'s key: letters, digits, '-', '_' and '.'")
    return kind(_object_name(ref, where, noun), key)


def _object_name(ref: Mapping, where: str, noun: str) -> str:
    name = _string(ref, "name", where, None, 1)
    if len(name) > 253 or not _OBJECT_NAME.match(name):
        raise SpecError(f"{where}.name {name!r} must be a {noun}'s name (a DNS subdomain)")
    return name
