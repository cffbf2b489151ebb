"""Fixtures for the operator tests: the API emulator in a thread, clients, the operator."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # k8s_emulator / k8s_server / k8s_patch

import pytest  # noqa: E402
from k8s_cluster import GVP, NS, Cluster, kubectl, wait_for  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# Read by epdserve.operator.main at import: resync every 3 s, retry API errors after 0.5 s.
FAST_OPERATOR = {"EPDSERVE_OPERATOR_RESYNC_SECONDS": "3", "EPDSERVE_OPERATOR_RETRY_SECONDS": "0.5"}


@pytest.fixture
def api(tmp_path, monkeypatch):
    """A running API emulator; KUBECONFIG points at it for the test's duration."""
    from k8s_server import EmulatorThread

    with EmulatorThread(tmp_path) as server:
        monkeypatch.setenv("KUBECONFIG", str(server.kubeconfig))
        yield server


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """An emulator with the CRD installed and the real operator running against it."""
    import os

    from k8s_server import EmulatorThread
    from kopf.testing import KopfRunner

    saved = {k: os.environ.get(k) for k in ("KUBECONFIG", *FAST_OPERATOR)}

    def restore_environment():
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

    os.environ.update(FAST_OPERATOR)
    with EmulatorThread(tmp_path_factory.mktemp("cluster")) as server:
        kubectl(server.kubeconfig, "apply", "--validate=false", "-f", str(ROOT / "crds"))
        args = ["run", "--standalone", "-A", "--liveness=", "-m", "epdserve.operator.main"]
        os.environ["KUBECONFIG"] = str(server.kubeconfig)  # read by the operator as it starts
        try:
            with KopfRunner(args, timeout=60) as runner:
                # Once kopf talks to the API it has logged in and run its startup handlers:
                # later tests (other folders too) must not inherit this KUBECONFIG.
                wait_for(lambda: _kopf_has_called(server.emulator), what="operator started")
                restore_environment()
                cluster = Cluster(server, runner)
                yield cluster
                cluster.api_client.close()
        finally:
            restore_environment()
        assert runner.exception is None, runner.output[-4000:]


def _kopf_has_called(emulator) -> bool:
    return any(r.headers.get("User-Agent", "").startswith("kopf") for r in list(emulator))


@pytest.fixture
def make_pool(cluster):
    """Create pools through the API; delete them (and wait for their children) afterwards."""
    created = []

    def make(body: dict) -> dict:
        body = copy.deepcopy(body)
        for field in ("uid", "generation"):
            body["metadata"].pop(field, None)
        body["metadata"]["namespace"] = NS
        created.append(body["metadata"]["name"])
        return cluster.custom.create_namespaced_custom_object(*GVP, NS, "inferencepools", body)

    def gone(name: str) -> bool:
        if cluster.pool(NS, name) is not None:
            cluster.custom.delete_namespaced_custom_object(*GVP, NS, "inferencepools", name)
        return not cluster.children(NS, name)

    yield make
    for name in created:  # wait_for retries through faults a test may have left behind
        wait_for(lambda n=name: gone(n), what=f"{name} and its children gone")
