"""The JSON-schema keywords that a grammar enforces, and the check that refuses every other one.

A schema becomes a grammar (engine/grammar.py); a keyword that the grammar cannot enforce would let
the model write a reply that does not validate, so such a schema is refused, naming the keyword and
where it is. Pure Python: the router checks tools' schemas with it before any grammar is built.

Supported (each enforced by construction, and checked by the tests with jsonschema):

- any schema: `type` (one name or a list), `enum`, `const`, `anyOf`, `$ref` to the same document
  (`#`, `#/$defs/...`, `#/definitions/...`) with `$defs` / `definitions`;
- objects: `properties`, `required`, `additionalProperties` (false when left out: a reply holds
  only the properties listed);
- arrays: `items`, `prefixItems`, `minItems`, `maxItems`;
- strings: `minLength`, `maxLength`, `pattern` (printable ASCII, a full match), `format` (only
  `uuid`: FORMATS). A string bounded in length holds no escape sequence; an unbounded one may;
- numbers and integers: `minimum`, `maximum`, `exclusiveMinimum`, `exclusiveMaximum`;
- annotations, which constrain nothing: ANNOTATIONS.

Refused: every other keyword, among them `allOf`, `oneOf`, `not`, `if` / `then` / `else`,
`uniqueItems`, `contains`, `minProperties`, `maxProperties`, `patternProperties`, `propertyNames`,
`dependentRequired`, `dependentSchemas`, `multipleOf` and the `unevaluated*` keywords.
"""

from __future__ import annotations

from typing import Any

ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "$schema",
        "$id",
        "$comment",
        "deprecated",
        "readOnly",
        "writeOnly",
    }
)
ENFORCED = frozenset(
    {
        "type",
        "enum",
        "const",
        "anyOf",
        "$ref",
        "$defs",
        "definitions",
        "properties",
        "required",
        "additionalProperties",
        "items",
        "prefixItems",
        "minItems",
        "maxItems",
        "minLength",
        "maxLength",
        "pattern",
        "format",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
    }
)
SUPPORTED = ENFORCED | ANNOTATIONS
# The formats that xgrammar's grammar enforces exactly. Others are refused: its `date` and
# `date-time` check the shape but not the calendar (June 31), `ipv4` allows leading zeros,
# `hostname` has no label length limit, and `email` can write an escape that JSON does not have
# (`\q`). A `pattern` can stand in.
FORMATS = frozenset({"uuid"})
LOCAL_REFS = ("#/$defs/", "#/definitions/")
_SCHEMA_MAPS = ("properties", "$defs", "definitions")  # name -> schema
_SCHEMA_LISTS = ("anyOf", "prefixItems")  # [schema, ...]
_SCHEMA_VALUES = ("items", "additionalProperties")  # one schema (or a boolean)


class UnsupportedSchema(ValueError):
    """A schema uses a keyword (or a value of one) that the grammar cannot enforce."""


def check_schema(schema: Any, where: str = "") -> None:
    """Raise UnsupportedSchema naming the first keyword of `schema` the grammar cannot enforce."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise UnsupportedSchema(f"the schema at {where or '/'} must be an object or a boolean")
    for keyword, value in schema.items():
        if keyword not in SUPPORTED:
            raise UnsupportedSchema(
                f"JSON schema keyword `{keyword}` (at {where or '/'}) is not supported: "
                f"the grammar cannot enforce it. Supported: {', '.join(sorted(ENFORCED))}"
            )
        _check_value(keyword, value, f"{where}/{keyword}")


def patterns(schema: Any):
    """Every `pattern` in a (checked) schema."""
    if not isinstance(schema, dict):
        return
    if isinstance(schema.get("pattern"), str):
        yield schema["pattern"]
    for keyword, value in schema.items():
        for child in _subschemas(keyword, value):
            yield from patterns(child)


def has_refs(schema: Any) -> bool:
    return isinstance(schema, dict) and (
        "$ref" in schema
        or any(
            has_refs(child)
            for keyword, value in schema.items()
            for child in _subschemas(keyword, value)
        )
    )


def rebased(schema: Any, base: str) -> Any:
    """`schema` moved to the JSON pointer `base` of a larger schema: each reference to itself
    (`#`, `#/$defs/...`) then points into `base`. Only schema positions are rewritten, never the
    data of an `enum` or `const`."""
    if not isinstance(schema, dict):
        return schema
    out = {}
    for keyword, value in schema.items():
        if keyword == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[keyword] = base + value[1:]
        elif keyword in _SCHEMA_MAPS and isinstance(value, dict):
            out[keyword] = {name: rebased(child, base) for name, child in value.items()}
        elif keyword in _SCHEMA_LISTS and isinstance(value, list):
            out[keyword] = [rebased(child, base) for child in value]
        elif keyword in _SCHEMA_VALUES:
            out[keyword] = rebased(value, base)
        else:
            out[keyword] = value
    return out


def _subschemas(keyword: str, value: Any) -> list:
    if keyword in _SCHEMA_MAPS and isinstance(value, dict):
        return list(value.values())
    if keyword in _SCHEMA_LISTS and isinstance(value, list):
        return value
    return [value] if keyword in _SCHEMA_VALUES else []


def _check_value(keyword: str, value: Any, where: str) -> None:
    if keyword in _SCHEMA_MAPS and isinstance(value, dict):
        for name, child in value.items():
            check_schema(child, f"{where}/{name}")
    elif keyword in _SCHEMA_LISTS and isinstance(value, list):
        for i, child in enumerate(value):
            check_schema(child, f"{where}/{i}")
    elif keyword in _SCHEMA_VALUES:
        check_schema(value, where)
    elif keyword == "$ref":
        _check_ref(value, where)
    elif keyword == "format" and value not in FORMATS:
        raise UnsupportedSchema(
            f"JSON schema `format` {value!r} (at {where}) is not supported; "
            f"supported formats: {', '.join(sorted(FORMATS))}"
        )
    elif keyword == "pattern":
        _check_pattern(value, where)


def _check_ref(value: Any, where: str) -> None:
    if not isinstance(value, str) or not (value == "#" or value.startswith(LOCAL_REFS)):
        raise UnsupportedSchema(
            f"JSON schema `$ref` {value!r} (at {where}) is not supported: only references "
            "into the same schema (#, #/$defs/..., #/definitions/...)"
        )


def _check_pattern(value: Any, where: str) -> None:
    # Outside printable ASCII, xgrammar compiles a pattern without excluding the characters that a
    # JSON string must escape, so the reply could break its string.
    if not isinstance(value, str) or not all(" " <= c <= "~" for c in value):
        raise UnsupportedSchema(
            f"JSON schema `pattern` (at {where}) must be printable ASCII; "
            r"write other characters as \uXXXX escapes"
        )


__all__ = [
    "ANNOTATIONS",
    "ENFORCED",
    "FORMATS",
    "SUPPORTED",
    "UnsupportedSchema",
    "check_schema",
    "has_refs",
    "patterns",
    "rebased",
]
