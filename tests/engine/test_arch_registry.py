"""The architecture registry is the one list of what loads: errors, make-model and the README."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from epdserve.engine import make_model
from epdserve.engine.models import arch as registry
from epdserve.engine.models.config import load_model_config

README = Path(__file__).resolve().parents[2] / "README.md"


def test_an_unsupported_architecture_is_refused_naming_every_supported_one(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FalconForCausalLM"]}))
    with pytest.raises(ValueError) as err:
        load_model_config(tmp_path)
    message = str(err.value)
    assert "FalconForCausalLM" in message
    for name in registry.supported_hf_names():
        assert name in message


def test_the_readme_lists_the_registry():
    block = re.search(r"<!-- architectures -->(.*?)<!-- /architectures -->", README.read_text())
    assert block, "README: the architectures list is missing"
    listed = re.findall(r"`([A-Za-z0-9]+)`", block.group(1))
    assert listed == registry.supported_hf_names()


def test_every_family_is_declared_once_and_make_model_offers_those_with_a_config():
    families = [a.family for a in registry.architectures()]
    assert len(families) == len(set(families))
    assert (
        tuple(a.family for a in registry.architectures() if a.hf_config is not None)
        == make_model.ARCHS
    )
    for arch in registry.architectures():
        assert registry.for_hf_names(["Nope", *arch.hf_names])[1] is arch
