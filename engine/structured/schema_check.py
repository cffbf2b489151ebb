"""JSON-schema keywords the grammar backend would silently ignore, named before a request runs.

xgrammar 0.2.9 compiles many schemas it cannot fully enforce: it drops the keyword and the
output may then violate the schema the client sent. Each rule below was checked against it
(a violating instance that the compiled grammar accepts); ``check_schema`` refuses those
schemas with ``unsupported JSON schema keyword 'X' at <JSON pointer>``. Annotations and
everything xgrammar does enforce pass through untouched.
"""

from __future__ import annotations

from typing import Any

from epdserve.engine.structured.pattern_cost import MAX_SCHEMA_COST, pattern_cost

MAX_NESTING = 64  # objects and arrays inside a schema (vLLM's bound); compile time grows fast

# assertions xgrammar ignores wherever they appear
IGNORED = frozenset(
    {
        "contains",
        "minContains",
        "maxContains",
        "dependentRequired",
        "dependentSchemas",
        "dependencies",
        "if",
        "then",
        "else",
        "not",
        "$recursiveRef",
        "$dynamicRef",
    }
)
# never constrain a value: allowed anywhere, also beside $ref, anyOf, oneOf, enum and const
ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "$schema",
        "$id",
        "$comment",
        "$anchor",
        "$dynamicAnchor",
        "$recursiveAnchor",
        "deprecated",
        "readOnly",
        "writeOnly",
        "contentEncoding",
        "contentMediaType",
        "discriminator",  # OpenAPI's (pydantic's tagged unions): the branches say it all
        "$defs",
        "definitions",
    }
)
# string formats xgrammar turns into a grammar; any other is accepted as any string
FORMATS = frozenset(
    {
        "email",
        "date",
        "time",
        "date-time",
        "duration",
        "ipv4",
        "ipv6",
        "hostname",
        "uuid",
        "uri",
        "uri-reference",
        "uri-template",
        "json-pointer",
        "relative-json-pointer",
    }
)
# value keywords of one type: ignored by xgrammar unless the schema says (or implies) the type
TYPED = {
    "minimum": "number",
    "maximum": "number",
    "exclusiveMinimum": "number",
    "exclusiveMaximum": "number",
    "multipleOf": "number",
    "minLength": "string",
    "maxLength": "string",
    "pattern": "string",
    "format": "string",
    "minItems": "array",
    "maxItems": "array",
    "uniqueItems": "array",
    "minProperties": "object",
    "maxProperties": "object",
    "required": "object",
}
_OBJECT_HINTS = ("properties", "additionalProperties", "patternProperties", "propertyNames")
_ARRAY_HINTS = ("items", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
_SCHEMA_VALUES = ("additionalProperties", "unevaluatedProperties", "items", "unevaluatedItems")


class UnsupportedSchema(ValueError):
    """A schema the backend would not enforce as written (``keyword``, ``pointer``)."""

    def __init__(self, keyword: str, pointer: str, why: str = ""):
        self.keyword, self.pointer = keyword, pointer
        super().__init__(
            f"unsupported JSON schema keyword '{keyword}' at {pointer}"
            + (f" ({why})" if why else "")
        )


def check_schema(schema: Any, spent: list[int] | None = None) -> None:
    """Raise ``UnsupportedSchema`` (a ``ValueError``) for the first keyword xgrammar would
    ignore, or ``ValueError`` for a schema nested deeper than ``MAX_NESTING``. ``spent``:
    a pattern-cost budget shared by several schemas (a structural tag's)."""
    if _too_deep(schema):
        raise ValueError(f"the JSON schema nests objects and arrays deeper than {MAX_NESTING}")
    _check(schema, "#", None, [0] if spent is None else spent)


def tag_schemas(tag: Any) -> list[Any]:
    """The JSON schemas inside an xgrammar structural tag (``{"type": "json_schema",
    "json_schema": ...}`` anywhere in its format)."""
    found, stack = [], [tag]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if node.get("type") == "json_schema" and "json_schema" in node:
                found.append(node["json_schema"])
            else:
                stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return found


def _too_deep(value: Any) -> bool:
    level = [value]
    for _ in range(MAX_NESTING):
        level = [
            child
            for node in level
            if isinstance(node, (dict, list))
            for child in (node.values() if isinstance(node, dict) else node)
            if isinstance(child, (dict, list))
        ]
        if not level:
            return False
    return True


def _pointer(base: str, *parts: str | int) -> str:
    for part in parts:
        base += "/" + str(part).replace("~", "~0").replace("/", "~1")
    return base


def _types(schema: dict, implied: str | None) -> set[str]:
    declared = schema.get("type")
    if isinstance(declared, str):
        return {declared}
    if isinstance(declared, list):
        return {t for t in declared if isinstance(t, str)}
    if implied:
        return {implied}
    if any(k in schema for k in _OBJECT_HINTS):
        return {"object"}
    if any(k in schema for k in _ARRAY_HINTS):
        return {"array"}
    return set()


def _check(schema: Any, at: str, implied: str | None, spent: list[int]) -> None:
    """``spent``: the pattern cost of the schema so far (pattern_cost.py)."""
    if not isinstance(schema, dict):
        return  # true/false, or a shape error the backend names
    types = _types(schema, implied)
    _check_keywords(schema, at, types)
    if "string" in types and isinstance(schema.get("pattern"), str):
        _charge(schema["pattern"], "pattern", at, spent)
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                if key == "patternProperties":
                    _charge(name, key, _pointer(at, key, name), spent)
                _check(sub, _pointer(at, key, name), None, spent)
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                _check(sub, _pointer(at, key, i), None, spent)
    for key in _SCHEMA_VALUES:
        if isinstance(schema.get(key), dict):
            _check(schema[key], _pointer(at, key), None, spent)
    if isinstance(schema.get("propertyNames"), dict):  # keys are strings: the type is implied
        _check(schema["propertyNames"], _pointer(at, "propertyNames"), "string", spent)


def _charge(pattern: str, keyword: str, at: str, spent: list[int]) -> None:
    """Patterns whose repeated groups would take xgrammar too long to spell out."""
    spent[0] += pattern_cost(pattern)
    if spent[0] > MAX_SCHEMA_COST:
        why = f"repeated groups too costly to build: {spent[0]}, at most {MAX_SCHEMA_COST}"
        raise UnsupportedSchema(keyword, at, why)


def _check_keywords(schema: dict, at: str, types: set[str]) -> None:
    for key, value in schema.items():
        if key in IGNORED or (key == "uniqueItems" and value is not False):
            raise UnsupportedSchema(key, at)
    _check_siblings(schema, at)
    for key in schema.keys() & TYPED.keys():
        wanted = TYPED[key]
        if not types and key != "uniqueItems":
            raise UnsupportedSchema(key, at, f"give the schema a type: it applies to {wanted}s")
    if "multipleOf" in schema and not _integral_multiple(schema["multipleOf"], types):
        raise UnsupportedSchema("multipleOf", at, "only an integer multiple of an integer type")
    if "string" in types:
        _check_string(schema, at)
    if "object" in types:
        _check_required(schema, at)
    allof = schema.get("allOf")
    if isinstance(allof, list) and len(allof) > 1:
        raise UnsupportedSchema("allOf", at, "with more than one schema")


def _check_siblings(schema: dict, at: str) -> None:
    """Beside these, xgrammar ignores every other assertion of the same schema."""
    for owner, also in (
        ("$ref", ()),
        ("anyOf", ()),
        ("oneOf", ()),
        ("allOf", ()),
        ("enum", ("type",)),
        ("const", ("type",)),
    ):
        if owner not in schema:
            continue
        if owner == "$ref" and not _local_ref(schema["$ref"]):
            raise UnsupportedSchema("$ref", at, "only local references ('#', '#/...')")
        for key in schema:
            if key != owner and key not in ANNOTATIONS and key not in also:
                raise UnsupportedSchema(key, at, f"beside '{owner}'")


def _local_ref(ref: Any) -> bool:
    return isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))


def _integral_multiple(value: Any, types: set[str]) -> bool:
    integral = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    return integral and not isinstance(value, bool) and "integer" in types and "number" not in types


def _check_string(schema: dict, at: str) -> None:
    fmt = schema.get("format")
    if fmt is not None and fmt not in FORMATS:
        raise UnsupportedSchema("format", at, f"'{fmt}' is not enforced")
    if "pattern" in schema or fmt is not None:
        for key in ("minLength", "maxLength"):
            if key in schema:
                raise UnsupportedSchema(key, at, "together with pattern or format")


def _check_required(schema: dict, at: str) -> None:
    """Strict mode allows no property outside ``properties`` unless the schema opens more:
    a required name outside them would be dropped, not enforced."""
    required = schema.get("required")
    if not isinstance(required, list):
        return
    if schema.get("additionalProperties") not in (None, False) or "patternProperties" in schema:
        return
    known = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    missing = [name for name in required if name not in known]
    if missing:
        raise UnsupportedSchema("required", at, f"'{missing[0]}' is not among the properties")
