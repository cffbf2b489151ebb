"""The corpus' JSON schemas: what structured outputs must enforce on a random model.

Every schema is bounded (strings by maxLength, a pattern, an enum or a format; numbers by
minimum/maximum; arrays by maxItems; recursion by maxItems on the way down) so a random model,
choosing among the tokens the grammar allows, completes it within the tests' ``max_tokens``.
Only keywords xgrammar 0.2.9 enforces appear (found by experiment: uniqueItems, contains, not,
if/then/else, allOf, overlapping oneOf and multipleOf over wide ranges are not enforced; nor
the formats date, ipv4 and email exactly, and jsonschema does not check date-time).
"""

from __future__ import annotations


def s(hi: int, lo: int = 0) -> dict:
    return {"type": "string", "minLength": lo, "maxLength": hi}


def word(hi: int = 8) -> dict:
    return {"type": "string", "pattern": f"^[a-z]{{1,{hi}}}$"}


def i(lo: int, hi: int) -> dict:
    return {"type": "integer", "minimum": lo, "maximum": hi}


def n(lo: float, hi: float) -> dict:
    return {"type": "number", "minimum": lo, "maximum": hi}


def e(*values) -> dict:
    return {"enum": list(values)}


def arr(items: dict, lo: int = 0, hi: int = 3) -> dict:
    return {"type": "array", "items": items, "minItems": lo, "maxItems": hi}


def obj(props: dict, required: list | None = None, **extra) -> dict:
    out = {"type": "object", "properties": props, "additionalProperties": False}
    out["required"] = list(props) if required is None else required
    return out | extra


BOOL, NULL = {"type": "boolean"}, {"type": "null"}
# xgrammar's format "date" allows Feb 30 and its "ipv4" leading zeros (jsonschema refuses both)
DATE = {"type": "string", "pattern": r"^20\d{2}-(0[1-9]|1[0-2])-(0[1-9]|1\d|2[0-8])$"}
POINT = obj({"x": n(-90, 90), "y": n(-180, 180)})
ADDRESS = obj({"street": word(), "city": word(), "zip": {"type": "string", "pattern": r"^\d{5}$"}})
NODE = {
    "type": "object",
    "properties": {"v": i(0, 99), "kids": arr({"$ref": "#/$defs/node"}, 0, 2)},
    "required": ["v"],
    "additionalProperties": False,
}

SCHEMAS: dict[str, dict] = {
    # primitives
    "boolean": BOOL,
    "null": NULL,
    "int_range": i(-5, 12),
    "int_negative": i(-1000, -10),
    "int_exclusive": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 7},
    "int_wide": i(-1_000_000, 1_000_000),
    "number_range": n(-1.5, 2.5),
    "number_exclusive": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
    "string_short": s(6),
    "string_min_max": s(5, 2),
    "string_pattern_code": {"type": "string", "pattern": r"^[A-Z]{2,4}-\d{1,3}$"},
    "string_pattern_hex": {"type": "string", "pattern": r"^#[0-9a-f]{6}$"},
    "string_pattern_alt": {"type": "string", "pattern": r"^(low|mid|high)(-[0-9])?$"},
    "format_uuid": {"type": "string", "format": "uuid"},
    "string_pattern_date": DATE,
    "enum_strings": e("red", "green", "blue"),
    "enum_mixed": e("a", 1, None, True, 2.5, {"x": 1}, [1, 2]),
    "enum_escapes": {"type": "string", "enum": ['say "hi"', "back\\slash", "tab\tstop", "é"]},
    "const_string": {"const": "fixed"},
    "const_object": {"const": {"k": [1, "two", None]}},
    "type_list": {"type": ["integer", "null"], "minimum": 0, "maximum": 5},
    # arrays
    "array_bools": arr(BOOL, 2, 4),
    "array_fixed_len": arr(NULL, 3, 3),
    "array_empty_ok": arr(i(0, 9), 0, 2),
    "array_of_enums": arr(e("n", "s", "e", "w"), 1, 4),
    "array_matrix": arr(arr(i(0, 9), 2, 2), 2, 2),
    "array_of_objects": arr(obj({"id": i(1, 999), "ok": BOOL}), 1, 3),
    "tuple_prefix_items": {
        "type": "array",
        "prefixItems": [i(0, 9), word(3), BOOL],
        "items": False,
        "minItems": 3,
    },
    # objects
    "object_empty": obj({}),
    "object_flat": obj({"name": word(), "age": i(0, 120), "admin": BOOL}),
    "object_optional": obj({"a": i(0, 9), "b": BOOL, "c": word(4)}, required=["a"]),
    "object_all_optional": obj({"p": NULL, "q": i(0, 3)}, required=[]),
    "object_nested_address": obj({"name": word(), "home": ADDRESS}),
    "object_deep": obj({"a": obj({"b": obj({"c": obj({"d": i(0, 9)})})})}),
    "object_additional_schema": {
        "type": "object",
        "properties": {"fixed": NULL},
        "required": ["fixed"],
        "additionalProperties": i(0, 9),
        "maxProperties": 3,
        "propertyNames": {"pattern": "^(fixed|[a-z]{1,4})$"},
    },
    "object_pattern_properties": {
        "type": "object",
        "patternProperties": {r"^x[0-9]$": i(0, 3)},
        "additionalProperties": False,
        "maxProperties": 2,
    },
    "object_min_properties": obj({"a": BOOL, "b": BOOL, "c": BOOL}, [], minProperties=2),
    "object_nullable_fields": obj(
        {"note": {"type": ["string", "null"], "maxLength": 4}, "count": {"anyOf": [i(0, 9), NULL]}}
    ),  # fmt: skip
    # $defs / $ref
    "ref_simple": {
        "$defs": {"pt": POINT},
        "type": "object",
        "additionalProperties": False,
        "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}},
        "required": ["a", "b"],
    },  # fmt: skip
    "ref_recursive_tree": {"$defs": {"node": NODE}, "$ref": "#/$defs/node"},
    "ref_definitions_draft7": {
        "definitions": {"color": e("c", "m", "y", "k")},
        "type": "array",
        "items": {"$ref": "#/definitions/color"},
        "maxItems": 3,
    },  # fmt: skip
    "ref_linked_list": {
        "$defs": {"cell": obj({"v": i(0, 9), "next": {"anyOf": [{"$ref": "#/$defs/cell"}, NULL]}})},
        "$ref": "#/$defs/cell",
    },
    # anyOf
    "anyof_primitives": {"anyOf": [i(0, 9), word(3), BOOL]},
    "anyof_tagged_objects": {
        "anyOf": [
            obj({"kind": {"const": "circle"}, "r": n(0, 10)}),
            obj({"kind": {"const": "rect"}, "w": i(1, 9), "h": i(1, 9)}),
        ]
    },  # fmt: skip
    "anyof_arrays": {"anyOf": [arr(i(0, 9), 1, 2), arr(BOOL, 1, 2)]},
    "oneof_disjoint": {"oneOf": [i(0, 4), i(10, 14), NULL]},
}

# shapes applications ask for (tool arguments, records, events)
SCHEMAS |= {
    "tool_weather_args": obj(
        {"city": word(), "unit": e("celsius", "fahrenheit"), "days": i(1, 7)}, required=["city"]
    ),  # fmt: skip
    "tool_search_args": obj(
        {"query": s(12, 1), "limit": i(1, 50), "filters": arr(e("news", "images", "video"), 0, 2)}
    ),  # fmt: skip
    "record_order": obj(
        {
            "order_id": {"type": "string", "pattern": r"^ORD-\d{4}$"},
            "items": arr(
                obj(
                    {
                        "sku": {"type": "string", "pattern": r"^[A-Z]{3}\d{2}$"},
                        "qty": i(1, 20),
                        "price": n(0, 999.99),
                    }
                ),
                1,
                3,
            ),
            "paid": BOOL,
        }
    ),  # fmt: skip
    "record_user_profile": obj(
        {
            "username": word(10),
            "email_ok": BOOL,
            "roles": arr(e("admin", "editor", "viewer"), 1, 3),
            "settings": obj({"theme": e("dark", "light"), "font_size": i(8, 32)}),
        }
    ),
    "record_event": obj(
        {"title": s(10, 1), "date": DATE, "attendees": arr(word(6), 0, 3), "location": POINT},
        required=["title", "date"],
    ),  # fmt: skip
    "record_log_entry": obj(
        {"level": e("debug", "info", "warning", "error"), "code": i(100, 599), "msg": s(12)}
    ),  # fmt: skip
    "record_sensor": obj(
        {"id": {"type": "string", "format": "uuid"}, "readings": arr(n(-40, 125), 1, 4), "ok": BOOL}
    ),  # fmt: skip
    "record_bank_transfer": obj(
        {
            "from": {"type": "string", "pattern": r"^[A-Z]{2}\d{8}$"},
            "to": {"type": "string", "pattern": r"^[A-Z]{2}\d{8}$"},
            "amount": n(0.01, 10000),
            "currency": e("EUR", "USD", "JPY"),
        }
    ),
    "geojson_point": obj(
        {
            "type": {"const": "Point"},
            "coordinates": {
                "type": "array",
                "prefixItems": [n(-180, 180), n(-90, 90)],
                "items": False,
                "minItems": 2,
            },
        }
    ),  # fmt: skip
    "http_request": obj(
        {
            "method": e("GET", "POST", "PUT", "DELETE"),
            "path": {"type": "string", "pattern": r"^(/[a-z]{1,6}){1,3}$"},
            "headers": arr(obj({"k": word(6), "v": s(6)}), 0, 2),
        }
    ),  # fmt: skip
    "semver_release": obj(
        {
            "version": {"type": "string", "pattern": r"^\d{1,2}\.\d{1,2}\.\d{1,2}$"},
            "stable": BOOL,
            "notes": arr(s(8), 0, 2),
        }
    ),  # fmt: skip
    "chess_move": obj(
        {
            "piece": e("K", "Q", "R", "B", "N", "P"),
            "from": {"type": "string", "pattern": "^[a-h][1-8]$"},
            "to": {"type": "string", "pattern": "^[a-h][1-8]$"},
            "capture": BOOL,
        }
    ),  # fmt: skip
    "org_chart": {
        "$defs": {
            "emp": obj({"name": word(6), "reports": arr({"$ref": "#/$defs/emp"}, 0, 2)})
        },  # fmt: skip
        "$ref": "#/$defs/emp",
    },
}
