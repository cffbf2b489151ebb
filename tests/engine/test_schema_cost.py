"""A schema's compile-cost estimate (issue #41): optional properties charged superlinearly,
the API refusing a schema over the bound with a 400 naming the field and the object."""

from __future__ import annotations

import pytest

from epdserve.engine.structured import StructuredOutputsParams as SO
from epdserve.engine.structured import backend
from epdserve.engine.structured.schema_cost import MAX_COMPILE_COST, SchemaCost

INT = {"type": "integer"}


def optional(n: int, value=INT, prefix: str = "p") -> dict:
    return {"type": "object", "properties": {f"{prefix}{i}": value for i in range(n)}}


def cost(schema) -> int:
    return SchemaCost().add(schema).total


def test_the_issues_schema_of_1000_optional_properties_is_refused_naming_its_object():
    schema = {"type": "object", "properties": {"form": optional(1000)}, "required": ["form"]}
    with pytest.raises(ValueError) as exc:
        backend.validate(SO(json=schema))
    message = str(exc.value)
    assert message.startswith("structured_outputs.json: the JSON schema would take too long")
    assert "1000 optional properties at #/properties/form" in message


def test_the_same_properties_all_required_cost_nothing_and_pass():
    schema = optional(1000)
    schema["required"] = list(schema["properties"])
    assert cost(schema) == 0
    backend.validate(SO(json=schema))


def test_optional_properties_cost_more_than_the_square_of_their_count():
    assert cost(optional(200)) > 4 * cost(optional(100)) > 0


def test_a_structural_tags_schemas_share_one_budget():
    half = optional(120)  # each alone passes; the two together do not
    assert (
        cost(half) <= MAX_COMPILE_COST < SchemaCost().add(half).add(optional(120, prefix="q")).total
    )
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "sequence",
            "elements": [
                {"type": "json_schema", "json_schema": half},
                {"type": "json_schema", "json_schema": optional(120, prefix="q")},
            ],
        },
    }
    with pytest.raises(ValueError, match=r"^structured_outputs\.structural_tag: .*too long"):
        backend.validate(SO(structural_tag=tag))


@pytest.mark.parametrize(
    "extra",
    [{"maxProperties": 20}, {"minProperties": 1}, {"additionalProperties": INT}],
    ids=["maxProperties", "minProperties", "open"],
)
def test_counting_or_opening_an_object_costs_more(extra):
    assert cost({**optional(50), **extra}) > cost(optional(50))


@pytest.mark.parametrize(
    "value",
    [{"type": ["string", "integer"]}, {"anyOf": [INT, {"type": "null"}]}, {}, True],
    ids=["type-list", "anyOf", "untyped", "true"],
)
def test_values_whose_end_is_ambiguous_cost_more_than_strings(value):
    assert (
        cost(optional(50, value)) > cost(optional(50, INT)) > cost(optional(50, {"type": "string"}))
    )


def test_a_ref_is_charged_as_the_value_it_points_at():
    direct = optional(50, {"type": "string"})
    via_ref = {**optional(50, {"$ref": "#/$defs/s"}), "$defs": {"s": {"type": "string"}}}
    missing = optional(50, {"$ref": "#/$defs/nowhere"})  # charged as any value
    assert cost(via_ref) == cost(direct) < cost(missing)
