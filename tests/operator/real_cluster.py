"""The operator's integration tests on a real control plane (issue #42 item 6).

etcd, kube-apiserver and kube-controller-manager from tools/bin (`make k8s-tools`), run by
the e2e harness's ControlPlane on 127.0.0.1 (no network namespaces, no root). No scheduler
and no kubelet: pods stay Pending unless a test reports them Running and Ready itself
(`make_pods_ready`, what a kubelet would write). The Deployment, ReplicaSet, EndpointSlice
and garbage-collector controllers are Kubernetes' own.

The CRD comes from crds/, the operator's ServiceAccount and RBAC from charts/epdserve rendered
by the real helm (the chart's operator Deployment is left out), and the operator runs as a
process, `epdserve operator --namespace default`, with a token of that ServiceAccount: it
holds the chart's grants and nothing more. The API server's audit log records the operator's
requests (`audit()`), so tests can count what it asked for and what it was refused.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import yaml
from k8s_cluster import FAST_OPERATOR, NS, ROOT, Clients, wait_for

sys.path.insert(0, str(ROOT / "e2e" / "harness"))
from controlplane import ControlPlane, MissingTools  # noqa: E402

from epdserve.operator.desired import OWNED_KINDS  # noqa: E402
from epdserve.operator.kube import Kube  # noqa: E402

__all__ = ["MissingTools", "RealCluster"]
RELEASE_NS = "epdserve-system"  # where the chart's ServiceAccount lives
NODE = "operator-test-node"  # a Node object for the pods; no kubelet runs it
OPERATOR_GROUP = f"system:serviceaccounts:{RELEASE_NS}"
RBAC_KINDS = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}
NOT_SERVED = {"ServiceMonitor", "ScaledObject"}  # no prometheus-operator or KEDA CRDs here
CHILD_KINDS = [k for k in OWNED_KINDS if k[1] not in NOT_SERVED] + [("v1", "Secret")]
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [{"level": "Metadata", "userGroups": [OPERATOR_GROUP]}, {"level": "None"}],
}


class AuditedControlPlane(ControlPlane):
    """The harness's control plane, its API server writing an audit log of the requests of
    the operator's ServiceAccount (metadata only: verb, object, response code)."""

    def _define(self, *args):
        super()._define(*args)
        policy = self.dir / "audit-policy.yaml"
        policy.write_text(yaml.safe_dump(AUDIT_POLICY))
        self.audit_log = self.dir / "audit.log"
        self.components["kube-apiserver"].argv += [
            f"--audit-policy-file={policy}",
            f"--audit-log-path={self.audit_log}",
        ]
        # QPS=20 per controller client by default: the garbage collector then takes a second
        # or more per deleted pool; the tests delete one per test.
        # No kubelet renews NODE's lease: the node lifecycle controller would taint it and
        # evict its pods, so it is off.
        self.components["kube-controller-manager"].argv += [
            "--kube-api-qps=200",
            "--kube-api-burst=400",
            "--controllers=*,-node-lifecycle-controller",
        ]


class RealCluster(Clients):
    """The control plane, admin clients (`core`, `apps`, `custom`, `kube`), the chart's RBAC
    and the operator process. `start()` once per session, `stop()` at its end."""

    def __init__(self, workdir: Path):
        self.dir = Path(workdir)
        self.plane = AuditedControlPlane(self.dir, "127.0.0.1")
        self.operator: subprocess.Popen | None = None
        self.operator_log = self.dir / "operator.log"
        self.operator_died = False
        self.entries: list[dict] = []  # the operator's audited requests, in order
        self._audit_offset = 0
        self._pod_ips = 0

    # -- start / stop --------------------------------------------------------------------

    def start(self) -> RealCluster:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        plane = self.plane.start(only=("etcd", "kube-apiserver"))
        super().__init__(plane.admin)
        self.kube = Kube(self.api_client.configuration)
        # The CRD before the controller manager, so that its garbage collector watches pools
        # from its first discovery on (it rediscovers resources only every 30 s).
        self.kubectl("apply", "-f", str(ROOT / "crds"))
        plane.wait_established("inferencepools.epdserve.io")
        plane.components["kube-controller-manager"].start()
        # the Node that make_pods_ready binds pods to (EndpointSlices skip pods of no Node)
        node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}}
        self.kube.request("POST", "/api/v1/nodes", body=node)
        account = self.install_chart_rbac()
        self.start_operator(self.service_account_kubeconfig(account))
        # pods need their namespace's `default` ServiceAccount, made by the controller manager
        wait_for(lambda: self.core.read_namespaced_service_account("default", NS), 60, "SA")

    def install_chart_rbac(self) -> str:
        """Apply the ServiceAccount and RBAC of charts/epdserve, rendered by the real helm for
        a release in RELEASE_NS that manages NS; returns the ServiceAccount's name."""
        rendered = self.helm(
            "template", "epdserve", str(ROOT / "charts" / "epdserve"),
            "--namespace", RELEASE_NS, f"--set=watchNamespaces={{{NS}}}",
        )  # fmt: skip
        docs = [d for d in yaml.safe_load_all(rendered) if d and d["kind"] in RBAC_KINDS]
        self.kubectl("create", "namespace", RELEASE_NS)
        self.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(docs))
        (account,) = [d["metadata"]["name"] for d in docs if d["kind"] == "ServiceAccount"]
        return account

    def service_account_kubeconfig(self, account: str) -> Path:
        """A kubeconfig holding a two-hour token of the ServiceAccount (TokenRequest)."""
        token = self.kubectl("create", "token", account, "-n", RELEASE_NS, "--duration=2h")
        server = {"server": self.plane.server, "certificate-authority": str(self.plane.pki.ca)}
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "real", "cluster": server}],
            "users": [{"name": account, "user": {"token": token.strip()}}],
            "contexts": [{"name": "operator", "context": {"cluster": "real", "user": account}}],
            "current-context": "operator",
        }
        path = self.dir / "operator.kubeconfig"
        path.write_text(yaml.safe_dump(config))
        return path

    def start_operator(self, kubeconfig: Path) -> None:
        """`epdserve operator` for NS, JSON log lines to operator.log; returns once it watches
        the pools."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBE", "EPDSERVE_"))}
        env.update(FAST_OPERATOR, KUBECONFIG=str(kubeconfig), PYTHONUNBUFFERED="1")
        script = Path(sys.executable).parent / "epdserve"
        argv = [str(script)] if script.exists() else [sys.executable, "-m", "epdserve.engine.cli"]
        argv += ["operator", "--namespace", NS, "--liveness", "", "--log-format", "json"]
        with open(self.operator_log, "ab") as out:
            self.operator = subprocess.Popen(
                argv, env=env, cwd=self.dir, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip

        def watching():
            if self.operator.poll() is not None:
                raise AssertionError(f"the operator exited: {self.operator_tail()}")
            return self.audit(verb="watch", resource="inferencepools")

        wait_for(watching, 60, "the operator to watch InferencePools")

    def stop(self) -> None:
        """Stop the operator (SIGINT, as kopf expects) and the control plane."""
        if self.operator is not None:
            self.operator_died = self.operator.poll() is not None
            if not self.operator_died:
                self.operator.send_signal(signal.SIGINT)
            try:
                self.operator.wait(20)
            except subprocess.TimeoutExpired:
                self.operator.kill()
                self.operator.wait(10)
        if getattr(self, "kube", None) is not None:
            self.kube.close()
            self.close()
        self.plane.stop()

    # -- tools ---------------------------------------------------------------------------

    def kubectl(self, *args: str, stdin: str | None = None, timeout: float = 60) -> str:
        """The real kubectl (tools/bin) as the cluster's admin; stdout of a command that must
        succeed."""
        done = self.plane.kubectl(*args, stdin=stdin, timeout=timeout)
        assert done.returncode == 0, f"kubectl {' '.join(args)}: {done.stderr}"
        return done.stdout

    def helm(self, *args: str) -> str:
        done = self.plane.helm(*args, timeout=120)
        assert done.returncode == 0, f"helm {' '.join(args)}: {done.stderr}"
        return done.stdout

    # -- looking -------------------------------------------------------------------------

    def children(self, namespace: str, pool: str) -> dict[tuple[str, str], dict]:
        """The objects of the kinds the operator makes labelled with the pool, by (kind,
        name); not the ReplicaSets and Pods the controllers make from its Deployments."""
        selector = f"epdserve.io/pool={pool}"
        return {
            (kind, item["metadata"]["name"]): item
            for api_version, kind in CHILD_KINDS
            for item in self.kube.list(api_version, kind, namespace, selector)
        }

    def make_pods_ready(self, namespace: str, pool: str) -> int:
        """Bind the pods of the pool's Deployments to NODE and report them Running and Ready,
        as the scheduler and their kubelet would (neither runs); returns how many pods there
        are."""
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        pods = []
        selector = f"epdserve.io/pool={pool}"
        for dep in self.apps.list_namespaced_deployment(namespace, label_selector=selector).items:
            labels = ",".join(f"{k}={v}" for k, v in dep.spec.selector.match_labels.items())
            pods += self.core.list_namespaced_pod(namespace, label_selector=labels).items
        for pod in pods:
            if any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or []):
                continue
            if not pod.spec.node_name:
                target = {"apiVersion": "v1", "kind": "Node", "name": NODE}
                binding = {"apiVersion": "v1", "kind": "Binding", "target": target}
                binding["metadata"] = {"name": pod.metadata.name}
                path = f"/api/v1/namespaces/{namespace}/pods/{pod.metadata.name}/binding"
                self.kube.request("POST", path, body=binding)
            self._pod_ips += 1
            ip = f"192.0.2.{self._pod_ips % 254 + 1}"  # TEST-NET-1: an address of nothing
            ready = [
                {"type": t, "status": "True", "lastTransitionTime": now}
                for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")
            ]
            status = {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}
            status.update(conditions=ready, startTime=now)
            self.core.patch_namespaced_pod_status(pod.metadata.name, namespace, {"status": status})
        return len(pods)

    def audit(self, since: int = 0, **match) -> list[dict]:
        """The operator's requests from entry `since` on, as audit events (`verb`, `code`,
        and `resource`, `subresource`, `namespace`, `name` of the objectRef), filtered by
        `match` (e.g. verb="create", resource="secrets")."""
        with open(self.plane.audit_log, "rb") as log:
            log.seek(self._audit_offset)
            chunk = log.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self._audit_offset += len(complete)
        for line in complete.splitlines():
            event = json.loads(line)
            if event["stage"] != "ResponseComplete" and event["verb"] != "watch":
                continue
            entry = dict(event.get("objectRef") or {}, verb=event["verb"])
            entry["code"] = (event.get("responseStatus") or {}).get("code")
            self.entries.append(entry)
        return [e for e in self.entries[since:] if all(e.get(k) == v for k, v in match.items())]

    def audit_mark(self) -> int:
        """Where the operator's audited requests stand now (`since` for `audit`)."""
        self.audit()
        return len(self.entries)

    def operator_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.operator_log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""
