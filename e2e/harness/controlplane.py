"""The e2e cluster's control plane: real etcd, kube-apiserver, kube-controller-manager and
kube-scheduler, built from Go modules by `make k8s-tools` (tools/build.sh, docs/e2e.md),
each its own process with its log in the work directory.

The API server serves TLS on the pod bridge's address (pods reach it through the
`kubernetes` Service; host clients directly), with the RBAC and Node authorizers,
ServiceAccount tokens signed by its own key and the default admission plugins plus
NodeRestriction. The controller manager runs every default controller with a
ServiceAccount per controller (`--use-service-account-credentials`), so garbage collection,
ReplicaSets, EndpointSlices, the root CA ConfigMaps and token publishing are Kubernetes'
own. `restart(name)` stops one component and starts it again on the same ports and data
(the fault tests).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import subprocess
import time
import urllib.request
from pathlib import Path

from pki import Pki

ROOT = Path(__file__).resolve().parents[2]
TOOLS = Path(os.environ.get("EPDSERVE_K8S_BIN") or ROOT / "tools" / "bin")  # make k8s-tools
SERVICE_CIDR = "198.19.0.0/16"
KUBERNETES_SERVICE_IP = "198.19.0.1"  # the first address of SERVICE_CIDR
ISSUER = "https://kubernetes.default.svc.cluster.local"
ORDER = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")


class MissingTools(RuntimeError):
    """The control-plane binaries are not built (`make k8s-tools`)."""


def tool(name: str) -> str:
    path = TOOLS / name
    if not os.access(path, os.X_OK):
        raise MissingTools(f"{path} is missing: run `make k8s-tools` (tools/build.sh)")
    return str(path)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Component:
    """One control-plane process: argv, log file, start/stop/restart."""

    def __init__(self, name: str, argv: list[str], log: Path, ready):
        self.name, self.argv, self.log, self.ready = name, argv, log, ready
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 120) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}): {self.tail()}")
            if self.ready():
                return
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} not ready after {timeout}s: {self.tail()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, sig)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class ControlPlane:
    """etcd + kube-apiserver + kube-controller-manager + kube-scheduler on `address`."""

    def __init__(self, workdir: Path, address: str):
        self.dir = Path(workdir) / "control-plane"
        self.address = address
        self.pki = Pki(self.dir / "pki")
        self.port = free_port(address)
        self.server = f"https://{address}:{self.port}"
        self.components: dict[str, Component] = {}
        self.node_kubeconfig: dict[str, Path] = {}

    def start(self, only: tuple[str, ...] = ORDER) -> ControlPlane:
        """Start the components in `only` (all by default; a CRD test needs only etcd and
        the API server), in start order."""
        binaries = {n: tool(n) for n in ORDER}
        self.pki.make_ca()
        names = ("", ".default", ".default.svc", ".default.svc.cluster.local")
        sans = [*(f"DNS:kubernetes{n}" for n in names), "DNS:localhost"]
        sans += [f"IP:{KUBERNETES_SERVICE_IP}", f"IP:{self.address}", "IP:127.0.0.1"]
        serving = self.pki.cert("apiserver", "kube-apiserver", sans=sans)
        self.admin = self.pki.kubeconfig("admin", self.server, "kubernetes-admin", "system:masters")
        kcm = self.pki.kubeconfig("kcm", self.server, "system:kube-controller-manager")
        sched = self.pki.kubeconfig("scheduler", self.server, "system:kube-scheduler")
        self._ssl = ssl.create_default_context(cafile=str(self.pki.ca))
        admin_cert = (self.pki.dir / "admin.crt", self.pki.dir / "admin.key")
        self._ssl.load_cert_chain(*map(str, admin_cert))
        self._define(binaries, serving, kcm, sched)
        try:
            for name in ORDER:
                if name in only:
                    self.components[name].start()
        except BaseException:
            self.stop()  # nothing left running when a component fails to start
            raise
        return self

    def kubectl(
        self, *args: str, stdin: str | None = None, timeout: float = 120, cache: Path | None = None
    ) -> subprocess.CompletedProcess:
        """The real kubectl as the cluster's admin; `cache`: its discovery cache directory
        (default: the control plane's own)."""
        cache = cache or self.dir / "kubectl-cache"
        argv = [tool("kubectl"), f"--kubeconfig={self.admin}", f"--cache-dir={cache}", *args]
        return subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=timeout)

    def wait_established(self, crd: str, timeout: float = 60, cache: Path | None = None) -> None:
        """Until ``crd`` is Established (``kubectl wait`` fails while it has no conditions)."""
        deadline = time.monotonic() + timeout
        while (left := int(deadline - time.monotonic())) > 0:
            args = ("wait", "--for=condition=Established", f"--timeout={left}s", f"crd/{crd}")
            done = self.kubectl(*args, timeout=left + 30, cache=cache)
            if done.returncode == 0:
                return
            if "accessor error" not in done.stderr:
                break
            time.sleep(0.2)
        raise AssertionError(f"crd/{crd} is not Established: {done.stderr}")

    def helm(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        """The real helm as the cluster's admin, with a home of its own (no user config)."""
        home = self.dir / "helm-home"
        env = {"HOME": str(home), "PATH": os.environ.get("PATH", ""), "KUBECONFIG": str(self.admin)}
        env.update({f"HELM_{k}_HOME": str(home / k.lower()) for k in ("CACHE", "CONFIG", "DATA")})
        argv = [tool("helm"), *args]
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)

    def node_config(self, node: str) -> Path:
        """A kubeconfig for the kubelet of `node` (user system:node:NODE in system:nodes)."""
        if node not in self.node_kubeconfig:
            self.node_kubeconfig[node] = self.pki.kubeconfig(
                f"node-{node}", self.server, f"system:node:{node}", "system:nodes"
            )
        return self.node_kubeconfig[node]

    def _define(self, binaries, serving, kcm: Path, sched: Path) -> None:
        etcd_port, etcd_peer = free_port(), free_port()
        etcd_url = f"http://127.0.0.1:{etcd_port}"
        peer_url = f"http://127.0.0.1:{etcd_peer}"
        etcd = [
            binaries["etcd"],
            "--name=e2e",
            f"--data-dir={self.dir / 'etcd'}",
            f"--listen-client-urls={etcd_url}",
            f"--advertise-client-urls={etcd_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=e2e={peer_url}",
            "--unsafe-no-fsync",  # a throwaway cluster: no fsync per write
            "--log-level=warn",
        ]
        pki = self.pki.dir
        apiserver = [
            binaries["kube-apiserver"],
            f"--etcd-servers={etcd_url}",
            f"--bind-address={self.address}",
            f"--advertise-address={self.address}",
            f"--secure-port={self.port}",
            f"--tls-cert-file={serving[0]}",
            f"--tls-private-key-file={serving[1]}",
            f"--client-ca-file={self.pki.ca}",
            f"--service-account-issuer={ISSUER}",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            "--authorization-mode=Node,RBAC",
            # Front-proxy client CA (kubeadm's settings): the controller manager and the
            # scheduler read it from extension-apiserver-authentication and log errors if absent.
            f"--requestheader-client-ca-file={self.pki.ca}",
            "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            "--enable-admission-plugins=NodeRestriction",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--allow-privileged=true",
            "--profiling=false",
            "--v=1",
        ]
        if self.address.startswith("127."):  # no pod network: nothing may reach a loopback
            apiserver.append("--endpoint-reconciler-type=none")  # `kubernetes` Endpoint
        controller_manager = [
            binaries["kube-controller-manager"],
            f"--kubeconfig={kcm}",
            f"--authentication-kubeconfig={kcm}",
            f"--authorization-kubeconfig={kcm}",
            "--bind-address=127.0.0.1",
            f"--secure-port={free_port()}",
            "--leader-elect=false",
            "--use-service-account-credentials=true",
            f"--service-account-private-key-file={pki / 'sa.key'}",
            f"--root-ca-file={self.pki.ca}",
            f"--cluster-signing-cert-file={self.pki.ca}",
            f"--cluster-signing-key-file={self.pki.ca_key}",
            "--horizontal-pod-autoscaler-sync-period=5s",
            "--v=1",
        ]
        scheduler = [
            binaries["kube-scheduler"],
            f"--kubeconfig={sched}",
            f"--authentication-kubeconfig={sched}",
            f"--authorization-kubeconfig={sched}",
            "--bind-address=127.0.0.1",
            f"--secure-port={free_port()}",
            "--leader-elect=false",
            "--v=1",
        ]
        self.etcd_url = etcd_url
        for name, argv, ready in (
            ("etcd", etcd, lambda: self._http_ok(f"{etcd_url}/health")),
            ("kube-apiserver", apiserver, lambda: self.healthy("/readyz")),
            ("kube-controller-manager", controller_manager, lambda: True),
            ("kube-scheduler", scheduler, lambda: True),
        ):
            self.components[name] = Component(name, argv, self.dir / f"{name}.log", ready)

    def _http_ok(self, url: str, context=None) -> bool:
        try:
            with urllib.request.urlopen(url, timeout=2, context=context) as resp:
                return resp.status == 200
        except OSError:
            return False

    def healthy(self, path: str = "/readyz") -> bool:
        """The API server answers `path` with 200 (admin credentials)."""
        return self._http_ok(self.server + path, self._ssl)

    def compact_etcd(self) -> int:
        """Compact etcd's history up to now (what its periodic compaction does): a watch
        resumed from an older resourceVersion then gets 410 Gone. Returns the revision."""

        def post(path: str, body: dict) -> dict:
            req = urllib.request.Request(
                self.etcd_url + path, json.dumps(body).encode(), method="POST"
            )
            with urllib.request.urlopen(req, timeout=10) as resp:
                return json.loads(resp.read())

        revision = int(post("/v3/kv/range", {"key": "Lw=="})["header"]["revision"])  # "/"
        post("/v3/kv/compaction", {"revision": str(revision), "physical": True})
        return revision

    def restart(self, name: str, sig: int = signal.SIGTERM, down_s: float = 0.0) -> None:
        """Stop one component (SIGTERM, or SIGKILL for a crash), wait `down_s`, start it."""
        component = self.components[name]
        component.stop(sig)
        time.sleep(down_s)
        component.start()

    def stop(self) -> None:
        for name in reversed(ORDER):
            if name in self.components:
                self.components[name].stop()

    def pids(self) -> set[int]:
        return {c.proc.pid for c in self.components.values() if c.proc is not None}

    def describe(self, tail: int = 8) -> str:
        return "\n".join(
            f"--- {c.name} ({'up' if c.alive() else 'down'})\n{c.tail(tail)}"
            for c in self.components.values()
        )
