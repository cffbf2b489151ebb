"""What a JSON schema costs xgrammar to compile, estimated before its request is queued.

Optional properties dominate (issue #41): after each one xgrammar offers every later one, so
an object of ``k`` optional properties builds about ``k * k`` grammar positions, and a
position costs more the more optional properties the whole schema has (``K``). Measured on
xgrammar 0.2.9 (bench/grammar_cost.py), one object costs about ``k * k * l * v * (K + 1275)``
units, ``l`` being a property's name in bytes plus 4, ``v`` how ambiguous its value's end is
(1: a string, object, array, boolean or enum of strings; 4: a number, whose digits may run
into the next key; 3 more per extra alternative of a union), 12 times more when the object takes
other properties too, and multiplied by the counts it must track under
``minProperties``/``maxProperties``. Compile time per unit grows with the vocabulary: the
worst schemas under ``MAX_COMPILE_COST`` are measured in docs/security.md.

Everything else (required properties, enums, ``anyOf`` branches, arrays, nesting) measured
linear in the spec's size, which ``MAX_SPEC_BYTES`` bounds; patterns have their own budget
(pattern_cost.py).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from epdserve.engine.structured.pattern_cost import pattern_cost

MAX_COMPILE_COST = 1_000_000_000  # per spec (docs/security.md: the worst that passes)
CROSS = 1275  # the optional properties of the rest of the schema, in the same units as K
UNION = 3  # per extra alternative of a value
NUMBER = 4  # a value whose end is not delimited: integer, number, or anything
ANY_TYPES = 6  # an untyped value may be any of the six JSON types
OPEN = 12  # other properties allowed: any key may follow each property (7.8 s at 3, 128k vocab)

_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
_VALUES = ("additionalProperties", "unevaluatedProperties", "items", "unevaluatedItems")
_OPENERS = ("additionalProperties", "unevaluatedProperties", "patternProperties")


class ObjectCost(NamedTuple):
    """One object schema's share: ``units`` before the whole schema's ``K`` factor."""

    units: int
    optional: int
    pointer: str


class SchemaCost:
    """The estimate over one or more schemas compiled as one grammar (a structural tag's)."""

    def __init__(self) -> None:
        self.objects: list[ObjectCost] = []
        self.pattern_units = 0  # pattern_cost of every pattern, its own budget

    def add(self, schema: Any, at: str = "#") -> SchemaCost:
        """Charge ``schema`` (and every schema inside it)."""
        _walk(schema, at, schema, self)
        return self

    @property
    def optional(self) -> int:
        return sum(o.optional for o in self.objects)

    @property
    def total(self) -> int:
        return sum(o.units for o in self.objects) * (self.optional + CROSS)

    def costliest(self) -> ObjectCost | None:
        return max(self.objects, default=None, key=lambda o: o.units)

    def check(self, limit: int = MAX_COMPILE_COST) -> None:
        """``ValueError`` naming the costliest object when the total is over ``limit``."""
        total = self.total
        if total <= limit:
            return
        worst = self.costliest()
        raise ValueError(
            f"the JSON schema would take too long to compile: cost {total:.3g}, at most "
            f"{limit:.3g}; most of it is the {worst.optional} optional properties at "
            f"{worst.pointer} (make properties required, or split the schema)"
        )


def _pointer(base: str, *parts: str | int) -> str:
    for part in parts:
        base += "/" + str(part).replace("~", "~0").replace("/", "~1")
    return base


def _walk(schema: Any, at: str, root: Any, cost: SchemaCost) -> None:
    if not isinstance(schema, dict):
        return
    if isinstance(schema.get("properties"), dict):
        _charge_object(schema, at, root, cost)
    if isinstance(schema.get("pattern"), str):
        cost.pattern_units += pattern_cost(schema["pattern"])
    for key in _MAPS:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                if key == "patternProperties":
                    cost.pattern_units += pattern_cost(name)
                _walk(sub, _pointer(at, key, name), root, cost)
    for key in _LISTS:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                _walk(sub, _pointer(at, key, i), root, cost)
    for key in (*_VALUES, "propertyNames"):
        if isinstance(schema.get(key), dict):
            _walk(schema[key], _pointer(at, key), root, cost)


def _charge_object(schema: dict, at: str, root: Any, cost: SchemaCost) -> None:
    required = schema.get("required")
    required = set(required) if isinstance(required, list) else set()
    optional = [(n, v) for n, v in schema["properties"].items() if n not in required]
    k = len(optional)
    if not k:
        return
    weight = sum((len(str(n).encode()) + 4) * _value_factor(v, root) for n, v in optional)
    counts = 1
    if isinstance(schema.get("minProperties"), int):
        counts = k + 1  # measured as costly as the widest maxProperties
    elif isinstance(schema.get("maxProperties"), int):
        counts = min(max(schema["maxProperties"], 0), k) + 1
    opened = any(schema.get(key) not in (None, False) for key in _OPENERS)
    cost.objects.append(ObjectCost(k * weight * counts * (OPEN if opened else 1), k, at))


def _value_factor(value: Any, root: Any, depth: int = 0) -> int:
    """How much a value's grammar makes its object's positions cost (see the module note)."""
    if value is False:
        return 1
    if not isinstance(value, dict):
        return NUMBER + UNION * (ANY_TYPES - 1)  # true: any value
    ref = value.get("$ref")
    if isinstance(ref, str):
        target = _resolve(root, ref) if depth < 8 else None  # a chain too long: any value
        return _value_factor(True if target is None else target, root, depth + 1)
    for key in ("anyOf", "oneOf"):
        if isinstance(value.get(key), list) and value[key]:
            factors = [_value_factor(v, root, depth + 1) for v in value[key]]
            return max(factors) + UNION * (len(factors) - 1)
    if "enum" in value or "const" in value:
        values = value.get("enum") if isinstance(value.get("enum"), list) else [value.get("const")]
        numeric = any(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
        return NUMBER if numeric else 1
    types = value.get("type")
    types = [types] if isinstance(types, str) else types
    if not isinstance(types, list) or not types:
        types = ["any"] * ANY_TYPES
    numeric = any(t in ("integer", "number", "any") for t in types)
    return (NUMBER if numeric else 1) + UNION * (len(types) - 1)


def _resolve(root: Any, ref: str) -> Any:
    """The schema a local ``$ref`` points at, or None."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node
