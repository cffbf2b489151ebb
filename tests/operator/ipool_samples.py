"""Sample InferencePool bodies for the operator tests (the examples/ files, plus variants)."""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def example(name: str, uid: str = "0000-uid", generation: int = 1) -> dict:
    """An example CR as the API would return it (with uid and generation)."""
    body = yaml.safe_load((ROOT / "examples" / f"{name}.yaml").read_text())
    body["metadata"].update(uid=uid, generation=generation)
    return body


def pool_body(name: str = "p", roles: dict | None = None, cache: dict | None = None, **spec):
    """A minimal valid colocated pool, with overrides."""
    body = {
        "apiVersion": "epdserve.io/v1alpha1",
        "kind": "InferencePool",
        "metadata": {"name": name, "namespace": "ns", "uid": "uid-1", "generation": 1},
        "spec": {
            "model": {"name": "tiny", "source": {"path": "/opt/model"}},
            "engine": {"image": "img:1"},
            "roles": roles or {"colocated": {"replicas": 1}},
        },
    }
    if cache is not None:
        body["spec"]["cache"] = cache
    body["spec"].update(copy.deepcopy(spec))
    return body
