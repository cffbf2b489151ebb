"""The architecture registry: one module per architecture in this package.

A module declares ``ARCHITECTURES``, a list of :class:`Architecture`: the ``config.json``
``architectures`` names it serves, how it reads their config into a ``ModelConfig``, its model
class (a ``DecoderLM`` with its hooks), how it loads the checkpoint's weights (names, fused
shards, per-layer pieces) and, for ``epdserve make-model``, the transformers config of a tiny
random checkpoint. Modules are found by listing this package: adding an architecture is adding
a module. The supported list in errors, ``make-model --arch`` and the README comes from here.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import Any


@dataclass(frozen=True)
class Architecture:
    """One architecture family.

    - ``parse(hf_name, text_config, top_config) -> ModelConfig``;
    - ``load_weights(model, w)``: ``w`` is this rank's ``layers.ShardedWeights``;
    - ``hf_config(preset, token_ids) -> transformers.PretrainedConfig`` for make-model (None:
      no make-model preset), ``presets`` the make-model presets it takes;
    - ``lora_refusal``: why LoRA adapters cannot apply to it (None: they can)."""

    family: str
    hf_names: tuple[str, ...]
    parse: Callable[[str, dict, dict], Any]
    load_weights: Callable[[Any, Any], None]
    model_class: Callable[..., Any] | None = None  # None: DecoderLM
    hf_config: Callable[[str, dict], Any] | None = None
    presets: tuple[str, ...] = ("tiny", "small")
    image: bool = False  # make-model writes an image processor too
    lora_prefix: str = "base_model.model.model."  # PEFT keys of its layers
    lora_refusal: str | None = None
    notes: dict = field(default_factory=dict)

    def model_cls(self):
        if self.model_class is not None:
            return self.model_class
        from epdserve.engine.models.decoder import DecoderLM

        return DecoderLM


@cache
def architectures() -> tuple[Architecture, ...]:
    """Every registered architecture, from every module of this package (sorted by family)."""
    found: list[Architecture] = []
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        found += getattr(module, "ARCHITECTURES", [])
    families = [a.family for a in found]
    dupes = {f for f in families if families.count(f) > 1}
    names = [n for a in found for n in a.hf_names]
    dupes |= {n for n in names if names.count(n) > 1}
    if dupes:  # a programming error: two modules claim one name
        raise RuntimeError(f"architecture registry: declared twice: {sorted(dupes)}")
    return tuple(sorted(found, key=lambda a: a.family))


def supported_hf_names() -> list[str]:
    """The ``config.json`` architecture names we load, sorted."""
    return sorted(n for a in architectures() for n in a.hf_names)


def for_hf_names(names: list[str]) -> tuple[str, Architecture] | None:
    """The first of ``names`` (a config's ``architectures``) that is registered, and its
    architecture; None when none is."""
    by_name = {n: a for a in architectures() for n in a.hf_names}
    return next(((n, by_name[n]) for n in names if n in by_name), None)


def by_family(family: str) -> Architecture:
    for arch in architectures():
        if arch.family == family:
            return arch
    raise KeyError(family)


def make_model_families() -> tuple[str, ...]:
    """``make-model --arch`` choices: the families with a tiny checkpoint config."""
    return tuple(a.family for a in architectures() if a.hf_config is not None)
