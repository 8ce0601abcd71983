"""Turn a CRD's OpenAPI v3 (structural) schema into a JSON Schema (draft 7) for validators.

The API server checks a HybridModel against the CRD's openAPIV3Schema; to check the same thing
offline (examples/, the chart's `hybridModel.spec` value) we convert that schema:

- OpenAPI's boolean `exclusiveMinimum`/`exclusiveMaximum` become JSON Schema's numeric form.
- An object with `properties` and no `x-kubernetes-preserve-unknown-fields` gets
  `additionalProperties: false`: the API server prunes unknown fields, and kubectl's default
  strict field validation rejects them, so a misspelled field is an error here too.
- `x-kubernetes-*` keys are dropped. Their CEL rules (`x-kubernetes-validations`) cannot be
  expressed in JSON Schema and are not checked.
- `nullable: true` adds "null" to the allowed types.
"""

from __future__ import annotations

import copy
from typing import Any

# OpenAPI keys whose value is one schema, a list of schemas, or a map of name -> schema.
_ONE_SCHEMA = ("items", "not", "additionalProperties")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf")
_SCHEMA_MAPS = ("properties",)
_DROPPED = ("nullable",)


def crd_version_schema(crd: dict[str, Any], version: str) -> dict[str, Any]:
    """The openAPIV3Schema of one served version of a CRD, as given.

    Raises:
        ValueError: if the CRD has no such version or it carries no schema.
    """
    for entry in crd.get("spec", {}).get("versions", []):
        if entry.get("name") == version:
            schema = entry.get("schema", {}).get("openAPIV3Schema")
            if not isinstance(schema, dict):
                raise ValueError(f"CRD version {version!r} has no openAPIV3Schema")
            return schema
    names = [entry.get("name") for entry in crd.get("spec", {}).get("versions", [])]
    raise ValueError(f"CRD has no version {version!r}; it has {names}")


def to_json_schema(openapi: dict[str, Any]) -> dict[str, Any]:
    """A draft-7 JSON Schema equivalent to a structural OpenAPI v3 schema (see module doc)."""
    if not isinstance(openapi, dict):
        raise TypeError(f"a schema must be a mapping, not {type(openapi).__name__}")
    return _convert(copy.deepcopy(openapi))


def _convert(node: dict[str, Any]) -> dict[str, Any]:
    preserve = node.get("x-kubernetes-preserve-unknown-fields") is True
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key.startswith("x-kubernetes-") or key in _DROPPED:
            continue
        if key in _SCHEMA_MAPS:
            out[key] = {name: _convert(sub) for name, sub in value.items()}
        elif key in _SCHEMA_LISTS:
            out[key] = [_convert(sub) for sub in value]
        elif key in _ONE_SCHEMA and isinstance(value, dict):
            out[key] = _convert(value)
        else:
            out[key] = value
    _numeric_exclusive_bounds(out)
    if node.get("nullable") is True and "type" in out:
        out["type"] = [out["type"], "null"]
    if "properties" in out and not preserve and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _numeric_exclusive_bounds(schema: dict[str, Any]) -> None:
    # OpenAPI 3.0 (JSON Schema draft 4) says `minimum: 0, exclusiveMinimum: true`;
    # draft 6 and later say `exclusiveMinimum: 0`.
    for bound, flag in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        if schema.get(flag) is True:
            if bound not in schema:
                raise ValueError(f"{flag}: true needs {bound}")
            schema[flag] = schema.pop(bound)
        elif schema.get(flag) is False:
            del schema[flag]


# What a structural schema may not say inside allOf/anyOf/oneOf/not (apiextensions' rule).
_NOT_IN_JUNCTORS = ("type", "description", "default", "additionalProperties", "nullable")
_INT_OR_STRING = [{"type": "integer"}, {"type": "string"}]


def structural_errors(schema: dict[str, Any]) -> list[str]:
    """Where a CRD's openAPIV3Schema breaks the structural-schema rules that decide pruning.

    The API server refuses a CRD whose schema is not structural; a structural schema prunes
    every field it does not declare, so the rules are checked here offline, with one more: an
    object that declares no fields and does not preserve them (`{type: object}`) prunes all of
    them, silently, and is reported (the root `metadata` aside: the API server owns it). A
    subset of Kubernetes' checks: CEL, defaults and list-map keys are not checked here.
    """
    errors: list[str] = []
    _structural(schema, "", errors, junctor=False)
    return errors


def _structural(node: dict[str, Any], path: str, errors: list[str], junctor: bool) -> None:
    where = path or "<root>"
    open_ = node.get("x-kubernetes-preserve-unknown-fields") is True
    int_or_string = node.get("x-kubernetes-int-or-string") is True
    if "$ref" in node:
        errors.append(f"{where}: $ref (a CRD inlines every type)")
    if junctor:
        errors.extend(f"{where}: {key} inside allOf/anyOf/oneOf/not" for key in _NOT_IN_JUNCTORS if key in node)
    elif "type" not in node and not (open_ or int_or_string):
        errors.append(f"{where}: no type")
    elif not isinstance(node.get("type", ""), str):
        errors.append(f"{where}: type {node['type']} is not one type")
    if int_or_string and ("type" in node or node.get("anyOf", _INT_OR_STRING) != _INT_OR_STRING):
        errors.append(f"{where}: x-kubernetes-int-or-string needs no type and anyOf [integer, string]")
    if "properties" in node and "additionalProperties" in node:
        errors.append(f"{where}: properties and additionalProperties together")
    if node.get("additionalProperties") is False:
        errors.append(f"{where}: additionalProperties: false (a CRD prunes instead)")
    fields = ("properties", "additionalProperties")
    if node.get("type") == "object" and not open_ and not any(k in node for k in fields) and path != ".metadata":
        errors.append(f"{where}: an object without fields (the API server prunes all of them)")
    for name, sub in (node.get("properties") or {}).items():
        _structural(sub, f"{path}.{name}", errors, junctor)
    for key, suffix in (("items", "[]"), ("additionalProperties", ".*")):
        if isinstance(node.get(key), dict):
            _structural(node[key], path + suffix, errors, junctor)
    for key in ("allOf", "anyOf", "oneOf"):
        for index, sub in enumerate(node.get(key, [])):
            if not (int_or_string and key == "anyOf"):
                _structural(sub, f"{path}.{key}[{index}]", errors, junctor=True)
    if isinstance(node.get("not"), dict):
        _structural(node["not"], f"{path}.not", errors, junctor=True)
