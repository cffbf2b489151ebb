"""The cost of a schema's patterns: counted groups weigh their bound squared times their
expanded body; escapes, classes and counted characters are one atom each."""

from __future__ import annotations

import pytest

from epdserve.engine.structured.pattern_cost import MAX_SCHEMA_COST, pattern_cost
from epdserve.engine.structured.schema_check import UnsupportedSchema, check_schema


@pytest.mark.parametrize(
    "pattern, cost",
    [
        (r"^\d{3}-\d{4}$", 0),  # no group: xgrammar spells nothing out
        (r"^[a-z]{1,60000}$", 0),
        (r"(a|b|c){1,1000}", 1000 * 1000 * 3),
        (r"(ab){3}", 3 * 3 * 2),
        (r"(a{1,10}){5}", 5 * 5 * 10),  # a counted atom expands its group's body
        (r"(x(a|b){4}){2}", 4 * 4 * 2 + 2 * 2 * (1 + 4 * 2)),
        (r"(ab)", 0),  # a group without a count
        (r"(?:ab){2,}", 2 * 2 * 2),  # {m,}: the m copies are spelled out
        (r"[(]{5}\({2}(x){2}", 2 * 2 * 1),  # parentheses in a class or escaped open nothing
        (r"[\]a]{3}", 0),
    ],
)
def test_a_pattern_costs_its_counted_groups(pattern, cost):
    assert pattern_cost(pattern) == cost


def test_a_costly_pattern_is_named_at_its_pointer():
    schema = {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "(a|b|c){1,5000}"}},
    }
    with pytest.raises(UnsupportedSchema) as err:
        check_schema(schema)
    assert (err.value.keyword, err.value.pointer) == ("pattern", "#/properties/code")
    assert str(MAX_SCHEMA_COST) in str(err.value)


def test_patterns_add_up_over_the_schema_including_pattern_properties():
    cheap = "(a|b){1,500}"  # 500 000 each: four fit, the fifth does not
    properties = {f"p{i}": {"type": "string", "pattern": cheap} for i in range(4)}
    check_schema({"type": "object", "properties": properties})
    with pytest.raises(UnsupportedSchema) as err:
        check_schema(
            {
                "type": "object",
                "properties": properties,
                "patternProperties": {cheap: {"type": "integer"}},
            }
        )
    assert err.value.keyword == "patternProperties"
    assert err.value.pointer == "#/patternProperties/(a|b){1,500}"


def test_everyday_patterns_pass():
    for pattern in (
        r"^[0-9a-f]{8}-([0-9a-f]{4}-){3}[0-9a-f]{12}$",
        r"^(\d{1,3}\.){3}\d{1,3}$",
        r"^\+?[1-9]\d{1,14}$",
        r"^([01]?[0-9]|2[0-3]):[0-5][0-9]$",
    ):
        check_schema({"type": "string", "pattern": pattern})
