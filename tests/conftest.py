"""Shared fixtures: tiny checkpoints built once per session, a real redis-server."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


class ModelStore:
    """Builds ``make-model`` checkpoints on first use and reuses them for the session."""

    def __init__(self, root):
        self.root = root
        self.built = {}

    def get(self, arch: str, seed: int = 0, preset: str = "tiny"):
        from epdserve.engine.make_model import make_model

        key = (arch, seed, preset)
        if key not in self.built:
            self.built[key] = make_model(arch, self.root / f"{arch}-{preset}-s{seed}", seed, preset)
        return self.built[key]


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> ModelStore:
    return ModelStore(tmp_path_factory.mktemp("models"))
