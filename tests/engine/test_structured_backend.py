"""The grammar backend's checks: a valid spec is built once, a bad one every time it comes."""

from __future__ import annotations

import pytest

from epdserve.engine.structured import StructuredOutputsParams as SO
from epdserve.engine.structured import backend


def test_a_valid_spec_is_built_once_and_a_bad_one_is_refused_every_time(monkeypatch):
    builds = []
    real = backend._grammar
    monkeypatch.setattr(backend, "_grammar", lambda p: builds.append(p.kind) or real(p))
    good = SO(regex="[0-9]{3}-only-once")
    for _ in range(3):
        backend.validate(good)
    assert builds == ["regex"]
    for _ in range(2):
        with pytest.raises(ValueError, match=r"^guided_regex: "):
            backend.validate(SO(regex="(unclosed"), field="guided_regex")
    assert builds == ["regex"] * 3


def test_length_bounded_strings_keep_out_raw_control_characters():
    text = backend.schema_text(SO(json={"type": "string", "minLength": 1, "maxLength": 4}))
    assert text == '{"type": "string", "pattern": "^[^\\"\\\\\\\\\\\\x00-\\\\x1f]{1,4}$"}'


def test_the_schema_text_keeps_the_property_order():
    schema = {"type": "object", "properties": {"zeta": {}, "alpha": {}}}
    assert backend.schema_text(SO(json=schema)).index("zeta") < backend.schema_text(
        SO(json=schema)
    ).index("alpha")
