"""The examples/ pools, adapted to this machine (tiny fp32 model, no GPUs), and helpers."""

from __future__ import annotations

import copy
import shutil
import threading
from pathlib import Path

import yaml
from events import stamp

ROOT = Path(__file__).resolve().parent.parent
NS = "default"
MODEL_PATH = "/models/tiny-llama"  # where the engine "image" carries the tiny model
SMALL_ENGINE = {"dtype": "float32", "maxModelLen": 512, "kvCacheMemory": "16Mi"}
KV_CACHE_BYTES = 16 << 20  # SMALL_ENGINE's kvCacheMemory, as an engine flag takes it

# The chart's values for the e2e operator: it manages `default`, resyncs every 2 s, retries a
# failed reconcile after 0.5 s (tests wait less) and logs at debug level.
OPERATOR_VALUES = (
    "--set=watchNamespaces={default}",
    "--set=resyncSeconds=2",
    "--set=verbose=true",  # kopf's debug lines show the watch restarts the fault tests cause
    "--set=extraEnv[0].name=EPDSERVE_OPERATOR_RETRY_SECONDS",
    "--set-string=extraEnv[0].value=0.5",
)


def readable_copy(src: Path, dst: Path) -> Path:
    """Copy a checkpoint with world-readable modes (pods run as a non-root uid)."""
    shutil.copytree(src, dst)
    for path in [dst, *dst.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return dst


def example(name: str) -> dict:
    return yaml.safe_load((ROOT / "examples" / f"{name}.yaml").read_text())


def for_this_machine(pool: dict, model_path: str | None = None, replicas: dict | None = None):
    """Drop GPU resources and scheduling constraints, shrink the engine, set replicas, and
    (optionally) point the model at a path the engine image carries."""
    pool = copy.deepcopy(pool)
    spec = pool["spec"]
    if model_path:
        spec["model"]["source"] = {"path": model_path}
    spec["engine"].update(SMALL_ENGINE)
    for role_name, role in spec["roles"].items():
        for key in ("resources", "nodeSelector", "tolerations"):
            role.pop(key, None)
        if replicas and role_name in replicas:
            role["replicas"] = replicas[role_name]
    if replicas and "router" in replicas:
        spec.setdefault("router", {})["replicas"] = replicas["router"]
    return pool


def write(tmp_path: Path, pool: dict) -> str:
    path = tmp_path / f"{pool['metadata']['name']}.yaml"
    path.write_text(yaml.safe_dump(pool))
    return str(path)


def condition(pool: dict | None, ctype: str) -> dict:
    conditions = ((pool or {}).get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == ctype), {})


def pod_names(cluster, selector: str) -> list[str]:
    return sorted(p["metadata"]["name"] for p in cluster.pods(NS, selector))


def ready_pod_ips(cluster, selector: str) -> list[str]:
    return sorted(
        p["status"]["podIP"]
        for p in cluster.pods(NS, selector)
        if any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in (p.get("status") or {}).get("conditions") or []
        )
    )


def failure(exc: BaseException) -> str:
    """A client error as a test records it: when (UTC, as the harness events), what, and
    what caused it (an APIConnectionError's cause tells refused from reset from cut)."""
    text = f"{stamp()} {exc!r}"
    cause = exc.__cause__ or exc.__context__
    for _ in range(4):
        if cause is None:
            break
        text += f" <- {cause!r}"
        cause = cause.__cause__ or cause.__context__
    return text


class Workers:
    """Client threads running ``self._run(worker)`` from ``with`` entry until exit (the run
    loop checks ``self._stop``)."""

    def __init__(self, workers: int):
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(workers)]

    def _run(self, worker: int) -> None:
        raise NotImplementedError

    def __enter__(self):
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        for t in self._threads:
            t.join(180)
