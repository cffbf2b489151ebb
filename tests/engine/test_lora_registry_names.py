"""Adapter names are model ids, metrics labels and log fields: the registry refuses names
with spaces, commas (vllm:lora_requests_info joins names with them) or control characters,
overlong ones, and more adapters than it can hold."""

from __future__ import annotations

import pytest

from epdserve.engine.lora import registry as registry_mod
from epdserve.engine.lora.random_adapters import write_random_adapters
from epdserve.engine.lora.registry import LoRARegistry


@pytest.fixture(scope="module")
def setup(models, tmp_path_factory):
    llama = models.get("llama")
    (path,) = write_random_adapters(llama, 1, out=tmp_path_factory.mktemp("loras"))
    return str(llama), str(path)


@pytest.mark.parametrize("name", ["a\nb", "two words", "tab\there", "x" * 257, "é", "a,b", ","])
def test_bad_names_are_refused_naming_the_field(setup, name):
    model, path = setup
    reg = LoRARegistry(model, 64, "tiny")
    with pytest.raises(ValueError, match="lora_name: must be 1-256 printable"):
        reg.add(name, path)
    assert reg.adapters == {}


@pytest.mark.parametrize("name", ["sql", "org/sql-lora", "v1.2_de", "x" * 256, "a+b", "a-b"])
def test_usual_names_are_taken(setup, name):
    model, path = setup
    assert LoRARegistry(model, 64, "tiny").add(name, path).lora_name == name


def test_lora_modules_with_a_comma_in_a_name_end_the_start(setup):
    model, path = setup
    reg = LoRARegistry(model, 64, "tiny")
    with pytest.raises(ValueError, match="lora_modules: a,b: lora_name: .* commas"):
        reg.add_modules([f"a,b={path}"])
    assert reg.adapters == {}


def test_the_registry_is_bounded(setup, monkeypatch):
    model, path = setup
    monkeypatch.setattr(registry_mod, "MAX_ADAPTERS", 2)
    reg = LoRARegistry(model, 64, "tiny")
    reg.add("a", path)
    reg.add("b", path)
    with pytest.raises(ValueError, match="already serves 2 adapters"):
        reg.add("c", path)
