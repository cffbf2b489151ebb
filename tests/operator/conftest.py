"""Fixtures for the operator tests: the real control plane with the operator as a process
(`cluster`, real_cluster.py), and the API emulator for what a real server cannot be made to
do: answer with injected errors, cut watches (`emulated_cluster`, `api`)."""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # k8s_cluster / real_cluster / k8s_emulator

import pytest  # noqa: E402
from k8s_cluster import FAST_OPERATOR, GVP, NS, ROOT, EmulatedCluster, wait_for  # noqa: E402


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """etcd, kube-apiserver and kube-controller-manager with the CRD, the chart's RBAC and
    `epdserve operator` running as the chart's ServiceAccount (once per session)."""
    from real_cluster import MissingTools, RealCluster

    try:
        real = RealCluster(tmp_path_factory.mktemp("real-cluster")).start()
    except MissingTools as exc:
        if os.environ.get("CI"):
            raise  # CI builds them (make k8s-tools): never skip there
        pytest.skip(str(exc))
    try:
        yield real
    finally:
        real.stop()
    assert not real.operator_died, f"the operator exited early:\n{real.operator_tail()}"
    assert real.operator.returncode == 0, real.operator_tail()
    refused = real.audit(code=403)
    assert not refused, f"the chart's RBAC refused the operator: {refused[:5]}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test on the real cluster reports the operator's log and the components'."""
    outcome = yield
    report = outcome.get_result()
    real = getattr(item, "funcargs", {}).get("cluster")
    if report.failed and real is not None and hasattr(real, "plane"):
        state = f"--- operator\n{real.operator_tail(30)}\n{real.plane.describe(8)}"
        report.sections.append(("real cluster", state))


@pytest.fixture
def api(tmp_path, monkeypatch):
    """A running API emulator; KUBECONFIG points at it for the test's duration."""
    from k8s_server import EmulatorThread

    with EmulatorThread(tmp_path) as server:
        monkeypatch.setenv("KUBECONFIG", str(server.kubeconfig))
        yield server


@pytest.fixture(scope="session")
def emulated_cluster(tmp_path_factory):
    """The emulator with the CRD installed and the real operator running in this process
    against it (faults are injected on the emulator's side)."""
    import yaml
    from k8s_server import EmulatorThread
    from k8s_store import CRDS
    from kopf.testing import KopfRunner

    saved = {k: os.environ.get(k) for k in ("KUBECONFIG", *FAST_OPERATOR)}

    def restore_environment():
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

    os.environ.update(FAST_OPERATOR)
    with EmulatorThread(tmp_path_factory.mktemp("emulator")) as server:
        crd = yaml.safe_load((ROOT / "crds" / "inferencepool.yaml").read_text())
        server.call(server.emulator.create, CRDS, None, crd)
        args = ["run", "--standalone", "-A", "--liveness=", "-m", "epdserve.operator.main"]
        os.environ["KUBECONFIG"] = str(server.kubeconfig)  # read by the operator as it starts
        try:
            with KopfRunner(args, timeout=60) as runner:
                # Once kopf talks to the API it has logged in and run its startup handlers:
                # later tests (other folders too) must not inherit this KUBECONFIG.
                wait_for(lambda: _kopf_has_called(server.emulator), what="operator started")
                restore_environment()
                emulated = EmulatedCluster(server, runner)
                yield emulated
                emulated.close()
        finally:
            restore_environment()
        assert runner.exception is None, runner.output[-4000:]


def _kopf_has_called(emulator) -> bool:
    return any(r.headers.get("User-Agent", "").startswith("kopf") for r in list(emulator))


def _pool_maker(cluster):
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


@pytest.fixture
def make_pool(cluster):
    """Pools on the real cluster: their children are garbage-collected by Kubernetes."""
    yield from _pool_maker(cluster)


@pytest.fixture
def make_emulated_pool(emulated_cluster):
    """Pools on the emulator: its own owner-reference collection removes the children."""
    yield from _pool_maker(emulated_cluster)
