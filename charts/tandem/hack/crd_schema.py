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
