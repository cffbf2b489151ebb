"""Sample InferencePool bodies for the operator tests (the examples/ files, plus variants)."""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def example_docs(path: Path) -> list[dict]:
    """The pools of one example file (a file may hold several, `---` apart)."""
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


# every pool of the examples as `example` names it: the file's stem, else `stem/pool`
EXAMPLE_POOLS = [
    name
    for path in EXAMPLES
    for docs in [example_docs(path)]
    for name in (
        [path.stem] if len(docs) == 1 else [f"{path.stem}/{d['metadata']['name']}" for d in docs]
    )
]


def example(name: str, uid: str = "0000-uid", generation: int = 1) -> dict:
    """An example CR as the API would return it (with uid and generation): `name` is a file's
    stem (its first pool) or `stem/pool`."""
    stem, _, pool = name.partition("/")
    docs = example_docs(ROOT / "examples" / f"{stem}.yaml")
    body = next(d for d in docs if not pool or d["metadata"]["name"] == pool)
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
