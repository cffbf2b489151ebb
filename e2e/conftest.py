"""Fixtures for the e2e tests: a one-node local cluster (harness/) with the operator running.

Needs root for network namespaces; without it every e2e test skips with that reason.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE / "harness"), str(HERE), str(ROOT / "tests" / "operator")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
from pools_e2e import MODEL_PATH, OPERATOR_VALUES, readable_copy  # noqa: E402

BIN = Path(sys.executable).parent


def runtime_mounts() -> list[dict]:
    """Make the venv's interpreter reachable for a non-root uid: if an ancestor of the base
    Python (e.g. /root, mode 0700) blocks others, the image gets a world-traversable tmpfs
    there with the one needed subtree bound back in (what a real image would simply have)."""
    base = Path(os.path.realpath(sys.base_prefix))
    for parent in reversed(base.parents):
        if parent != Path("/") and not parent.stat().st_mode & stat.S_IXOTH:
            child = Path(*base.parts[: len(parent.parts) + 1])
            return [
                {"path": str(parent), "source": None},
                {"path": str(child), "source": str(child)},
            ]
    return []


_CLUSTERS: list = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing e2e test reports the cluster's state (pods, pools, log tails)."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and _CLUSTERS and item.get_closest_marker("e2e"):
        from cluster import describe

        report.sections.append(("e2e cluster state", describe(_CLUSTERS[0])))


@pytest.fixture(scope="session")
def e2e_workdir(tmp_path_factory) -> Path:
    from netns import can_make_namespaces

    reason = can_make_namespaces()
    if reason:
        pytest.skip(reason)
    return tmp_path_factory.mktemp("e2e")


@pytest.fixture(scope="session")
def tiny_models(e2e_workdir) -> dict[str, Path]:
    """Tiny checkpoints, world-readable: {"llama": dir}."""
    from epdserve.engine.make_model import make_model

    built = make_model("llama", e2e_workdir / "build" / "tiny-llama", seed=0)
    return {"llama": readable_copy(Path(built), e2e_workdir / "image" / "tiny-llama")}


@pytest.fixture(scope="session")
def cluster(e2e_workdir, tiny_models):
    """The local cluster on the real control plane, with the operator installed by `helm
    install` of charts/epdserve (CRD, RBAC, ServiceAccount, the operator's pod)."""
    from cluster import LocalCluster
    from controlplane import MissingTools
    from kubelet import NodeConfig

    weights = e2e_workdir / "pv" / "model-weights"
    weights.mkdir(parents=True)
    readable_copy(tiny_models["llama"], weights / "llama-3.1-8b-instruct")
    weights.chmod(0o755)
    node = NodeConfig(
        image_env={
            "PATH": f"{BIN}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": "1",  # stands in for a CPU limit on this small machine
            "PYTHONDONTWRITEBYTECODE": "1",
            "LANG": "C.UTF-8",
        },
        image_files=[
            *runtime_mounts(),
            {"path": MODEL_PATH, "source": str(tiny_models["llama"])},
        ],
    )
    try:
        local = LocalCluster(e2e_workdir / "cluster", node)
        local.__enter__()
    except MissingTools as exc:
        if os.environ.get("CI"):
            raise  # CI builds them (make k8s-tools): never skip there
        pytest.skip(str(exc))
    try:
        local.claim("model-weights", weights)
        local.install_operator(*OPERATOR_VALUES)
        # The garbage collector learns new resources only every 30 s: until then deleting a
        # pool leaves its children waiting. A controller manager started after helm put the
        # CRD in knows pools from its start (tests/operator start it after the CRD).
        local.control.restart("kube-controller-manager")
        _CLUSTERS.append(local)
        yield local
        _CLUSTERS.clear()
    finally:
        local.__exit__(None, None, None)
    leaks = local.leaks()
    assert not leaks, f"left running after the e2e run: {leaks}"
