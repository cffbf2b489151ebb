"""Helpers for the tests that drive the real operator through an API: the client handles of
the real control plane (real_cluster.RealCluster) and of the API emulator (EmulatedCluster,
the fault tests), and polling."""

from __future__ import annotations

import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NS = "default"
GVP = ("epdserve.io", "v1alpha1")
REDIS = {"backend": "redis", "redis": {"managed": True}}
# Read by epdserve.operator.main at import: resync every 3 s, retry API errors after 0.5 s.
FAST_OPERATOR = {"EPDSERVE_OPERATOR_RESYNC_SECONDS": "3", "EPDSERVE_OPERATOR_RETRY_SECONDS": "0.5"}


class Clients:
    """Official-client APIs bound to one kubeconfig, and the pool lookup every test uses."""

    def __init__(self, kubeconfig: Path):
        from kubernetes import client, config

        self.kubeconfig = Path(kubeconfig)
        self.api_client = config.new_client_from_config(config_file=str(kubeconfig))
        self.core = client.CoreV1Api(self.api_client)
        self.apps = client.AppsV1Api(self.api_client)
        self.custom = client.CustomObjectsApi(self.api_client)

    def close(self) -> None:
        self.api_client.close()

    def pool(self, namespace: str, name: str) -> dict | None:
        from kubernetes.client.exceptions import ApiException

        try:
            return self.custom.get_namespaced_custom_object(*GVP, namespace, "inferencepools", name)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise


class EmulatedCluster(Clients):
    """The API emulator (faults injected with `server.call(emulator.fail, ...)`) and the
    operator running in this process (kopf.testing.KopfRunner)."""

    def __init__(self, server, kopf_runner):
        super().__init__(server.kubeconfig)
        self.server = server
        self.emulator = server.emulator
        self.runner = kopf_runner

    def children(self, namespace: str, pool: str) -> dict[tuple[str, str], dict]:
        """Every stored object labelled with the pool, by (kind, name)."""
        return {
            (obj.get("kind") or key[0].rsplit("/", 1)[1], key[2]): obj
            for key, obj in list(self.emulator.store.items())
            if key[1] == namespace
            and (obj["metadata"].get("labels") or {}).get("epdserve.io/pool") == pool
        }


def wait_for(predicate, timeout: float = 90, what: str = "condition"):
    """Poll `predicate` until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
        except Exception as exc:  # transient API errors while polling
            last = exc
        if last and not isinstance(last, Exception):
            return last
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}; last: {last!r}")


def patch_pool(cluster, name: str, patch: dict) -> None:
    cluster.custom.patch_namespaced_custom_object(*GVP, NS, "inferencepools", name, patch)


def deployment(cluster, name: str):
    return cluster.apps.read_namespaced_deployment(name, NS)


def condition(pool: dict | None, ctype: str) -> dict:
    conditions = ((pool or {}).get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == ctype), {})
