"""Fixtures for the operator tests: the API emulator in a thread, clients, the operator."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # k8s_emulator / k8s_server / k8s_patch

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def api(tmp_path, monkeypatch):
    """A running API emulator; KUBECONFIG points at it for the test's duration."""
    from k8s_server import EmulatorThread

    with EmulatorThread(tmp_path) as server:
        monkeypatch.setenv("KUBECONFIG", str(server.kubeconfig))
        yield server


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


def wait_for(predicate, timeout: float = 30, what: str = "condition"):
    """Poll `predicate` until it returns something truthy; fail after `timeout` seconds."""
    import time

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


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """An emulator with the CRD installed and the real operator running against it."""
    import os

    from k8s_server import EmulatorThread

    os.environ["EPDSERVE_OPERATOR_RESYNC_SECONDS"] = "3"
    os.environ["EPDSERVE_OPERATOR_RETRY_SECONDS"] = "0.5"
    old_kubeconfig = os.environ.get("KUBECONFIG")
    with EmulatorThread(tmp_path_factory.mktemp("cluster")) as server:
        os.environ["KUBECONFIG"] = str(server.kubeconfig)
        import yaml
        from kopf.testing import KopfRunner

        crd = yaml.safe_load((ROOT / "crds" / "inferencepool.yaml").read_text())
        server.call(
            server.emulator.create, "apiextensions.k8s.io/v1/customresourcedefinitions", None, crd
        )
        args = ["run", "--standalone", "-A", "--liveness=", "-m", "epdserve.operator.main"]
        try:
            with KopfRunner(args, timeout=60) as runner:
                cluster = Cluster(server, runner)
                yield cluster
                cluster.api_client.close()
        finally:
            if old_kubeconfig is None:
                os.environ.pop("KUBECONFIG", None)
            else:
                os.environ["KUBECONFIG"] = old_kubeconfig
        assert runner.exception is None, runner.output[-4000:]
