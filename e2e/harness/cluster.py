"""A one-node cluster on this machine: the real control plane (controlplane.py: etcd,
kube-apiserver, kube-controller-manager, kube-scheduler) plus the node's parts (a kubelet
running pods as processes in network namespaces, a userspace kube-proxy, DNS as hosts
files), with the epdserve operator installed by the real `helm` from charts/epdserve.
`with LocalCluster(...) as c:` starts it; leaving the block stops everything it started
(also on failure) and `leaks()` says what survived.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from controlplane import ControlPlane
from events import EVENTS
from kapi import Api
from kubelet import Kubelet, NodeConfig
from netns import GATEWAY, PodNetwork
from services import ServiceRouting
from svcproxy import ServiceProxy

ROOT = Path(__file__).resolve().parents[2]
OPERATOR_NS = "epdserve-system"


class LocalCluster:
    """Control plane + kubelet + service routing; see module docstring."""

    def __init__(self, workdir: Path, node: NodeConfig):
        self.workdir = Path(workdir)
        self.node = node
        self.control: ControlPlane | None = None
        self.network = PodNetwork()
        self.proxy: ServiceProxy | None = None
        self.kubelet: Kubelet | None = None
        self.api: Api | None = None
        self.errors: list[str] = []
        self.claims: dict[str, Path] = {}  # claim name -> host directory of its volume
        self._stop = threading.Event()
        self._loop_thread: threading.Thread | None = None

    # -- start ---------------------------------------------------------------------------

    def start(self) -> LocalCluster:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.network.open()
        self.control = ControlPlane(self.workdir, GATEWAY).start()
        self.kubeconfig = self.control.admin
        self.api = Api(self.kubeconfig)
        self.proxy = ServiceProxy()
        node_api = Api(self.control.node_config(self.node.name))
        self.kubelet = Kubelet(node_api, self.network, self.node, self.workdir).start()
        self.routing = ServiceRouting(self.api, self.network, self.proxy, self.kubelet)
        self._loop_thread = threading.Thread(target=self._loop, name="kube-proxy", daemon=True)
        self._loop_thread.start()
        # What a fresh cluster has once its controllers ran: the default ServiceAccount and
        # the root CA ConfigMap in `default`.
        wait_for(lambda: self.api.get("ServiceAccount", "default", "default"), 60, "default SA")
        wait_for(lambda: self.api.get("ConfigMap", "default", "kube-root-ca.crt"), 60, "root CA")
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.routing.sync()
            except Exception as exc:  # transient API errors: retried next round
                self.errors.append(f"service routing: {exc!r}")
            self._stop.wait(0.3)

    def claim(self, name: str, path: Path, namespace: str = "default") -> None:
        """A PersistentVolume at host `path` and a claim `name` bound to it (static
        provisioning: the claim names the volume; the PV controller binds them)."""
        pv = {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": f"{namespace}-{name}"},
            "spec": {
                "capacity": {"storage": "10Gi"},
                "accessModes": ["ReadWriteMany", "ReadOnlyMany"],
                "persistentVolumeReclaimPolicy": "Retain",
                "storageClassName": "",
                "hostPath": {"path": str(path), "type": "Directory"},
            },
        }
        pvc = {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "accessModes": ["ReadWriteMany"],
                "storageClassName": "",
                "volumeName": pv["metadata"]["name"],
                "resources": {"requests": {"storage": "10Gi"}},
            },
        }
        self.claims[name] = Path(path)
        self.api.create("PersistentVolume", None, pv)
        self.api.create("PersistentVolumeClaim", namespace, pvc)

        def bound():
            got = self.api.get("PersistentVolumeClaim", namespace, name) or {}
            return (got.get("status") or {}).get("phase") == "Bound"

        wait_for(bound, 60, f"claim {name} to bind")

    def helm(self, *args: str, check: bool = True, timeout: float = 300, stderr=False) -> str:
        """The real helm (tools/bin) against this cluster; returns stdout (and stderr)."""
        done = self.control.helm(*args, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed: {done.stderr}")
        return done.stdout + (done.stderr if stderr else "")

    def install_operator(self, *values: str, name: str = "epdserve") -> str:
        """`helm install` of charts/epdserve into epdserve-system (`values`: helm's --set
        flags): the CRD, RBAC, the ServiceAccount and the operator's Deployment, whose pod
        the kubelet runs; helm waits for it to be ready."""
        return self.helm(
            "install", name, str(ROOT / "charts" / "epdserve"),
            "--namespace", OPERATOR_NS, "--create-namespace",
            "--wait", "--timeout", "180s", *values,
        )  # fmt: skip

    def operator_log(self) -> str:
        return "".join(
            self.log(OPERATOR_NS, p["metadata"]["name"])
            for p in self.pods(OPERATOR_NS, "app.kubernetes.io/name=epdserve-operator")
        )

    # -- use -----------------------------------------------------------------------------

    def kubectl(self, *args: str, check: bool = True, timeout: float = 120) -> str:
        """The real kubectl (tools/bin) as the cluster's admin; returns stdout."""
        done = self.control.kubectl(*args, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {done.stderr}")
        return done.stdout

    def service_ip(self, namespace: str, name: str, serving: bool = True) -> str:
        """The Service's cluster IP; with `serving`, once this node's service proxy forwards
        it to a ready endpoint (or after 30 s): as on any node, the proxy trails the
        EndpointSlice, which trails the pod's readiness."""
        svc = self.api.get("Service", namespace, name)
        ip = (svc or {}).get("spec", {}).get("clusterIP", "")
        deadline = time.monotonic() + 30
        while serving and ip and ip != "None" and not self.proxy.serves(ip):
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        return ip

    def pods(self, namespace: str, selector: str = "") -> list[dict]:
        return self.api.list("Pod", namespace, selector)

    def log(self, namespace: str, pod: str, container: str = "") -> str:
        """A container's log (all restarts), like `kubectl logs`."""
        pod_dir = self.workdir / "pods" / f"{namespace}_{pod}"
        files = sorted(pod_dir.glob(f"{container or '*'}.log"))
        return "".join(f.read_text(errors="replace") for f in files)

    # -- stop ----------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop service routing, pods (the operator's too), proxy, control plane, network
        (each step guarded)."""
        steps = [
            self._stop_routing,
            lambda: self.kubelet and self.kubelet.close(),
            lambda: self.proxy and self.proxy.close(),
            lambda: self.api and self.api.close(),
            lambda: self.control and self.control.stop(),
            self.network.close,
        ]
        for step in steps:
            try:
                step()
            except Exception as exc:
                self.errors.append(f"teardown: {exc!r}")

    def _stop_routing(self) -> None:
        self._stop.set()
        if self._loop_thread is not None:
            self._loop_thread.join(15)

    def started_groups(self) -> set[int]:
        groups = set(self.kubelet.started_pids) if self.kubelet else set()
        return groups | (self.control.pids() if self.control else set())

    def leaks(self) -> list[str]:
        """Processes of any group this cluster started, and namespaces of this run, still there."""
        made = self.kubelet.made_dirs if self.kubelet else []
        return (
            leaked_processes(self.started_groups())
            + self.network.leftovers()
            + [f"mount point {d}" for d in made if d.exists()]
            + [f"tmpfs {p}" for p in sorted(self.kubelet.tmpfs if self.kubelet else ())]
        )

    def __enter__(self) -> LocalCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


def leaked_processes(groups: set[int]) -> list[str]:
    """`pid (cmd)` of every live process whose process group is in `groups`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            pgid = int(stat.rsplit(")", 1)[1].split()[2])
            state = stat.rsplit(")", 1)[1].split()[0]
            if pgid in groups and state != "Z":
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
                found.append(f"pid {entry.name} ({cmd})")
        except (OSError, ValueError, IndexError):
            continue
    return found


def wait_for(predicate, timeout: float = 60, what: str = "condition", interval: float = 0.3):
    """Poll until `predicate()` is truthy; fail with the last value after `timeout` s."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
        except Exception as exc:
            last = exc
        if last and not isinstance(last, Exception):
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")


def describe(cluster: LocalCluster, tail: int = 15) -> str:
    """Pods, pools and log tails: what a failing e2e test prints to explain itself."""
    out, live = [], set()
    try:
        for pod in cluster.api.list("Pod"):  # the operator's pod among them
            live.add(f"{pod['metadata']['namespace']}_{pod['metadata']['name']}")
            status = pod.get("status") or {}
            containers = status.get("containerStatuses") or [{}]
            state = ",".join(next(iter(c.get("state") or {"?": 0})) for c in containers)
            out.append(
                f"pod {pod['metadata']['name']} {status.get('podIP')} phase={status.get('phase')}"
                f" state={state} restarts={[c.get('restartCount') for c in containers]}"
            )
        out.append(cluster.kubectl("get", "ipool", "-o", "wide", check=False))
    except Exception as exc:
        out.append(f"(API not answering: {exc!r})")
    for log in sorted((cluster.workdir / "pods").glob("*/*.log")):
        if live and log.parent.name not in live:
            continue  # pods of earlier tests
        lines = log.read_text(errors="replace").splitlines()[-tail:]
        out.append(f"--- {log.parent.name}/{log.name}\n" + "\n".join(lines))
    if cluster.control is not None:
        out.append(cluster.control.describe(tail // 2))
    errors = cluster.errors[-tail:] + (cluster.kubelet.errors[-tail:] if cluster.kubelet else [])
    out.append("--- harness errors\n" + "\n".join(errors))
    out.append("--- harness events (last 60)\n" + "\n".join(EVENTS.tail(60)))
    return "\n".join(out)
