"""The control plane's missing parts: Deployment controller, ClusterIP allocator,
EndpointSlice controller, plus the node's service plumbing (kube-proxy, cluster DNS as hosts
files). Each is a level-triggered `sync()` over the API's current state, run in a loop.

Simplifications (documented in docs/operations.md's e2e section): no ReplicaSets (pods are
owned by their Deployment), a RollingUpdate surges a whole new set of pods and deletes the
old ones once the new set is ready, and every pod is bound to the one node.
"""

from __future__ import annotations

import hashlib
import json
import threading
import uuid

import podspec
from probes import resolve_port

TEMPLATE_HASH = "pod-template-hash"


def template_hash(template: dict) -> str:
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]


def matches(selector: dict, labels: dict | None) -> bool:
    labels = labels or {}
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def pod_ready(pod: dict) -> bool:
    status = pod.get("status") or {}
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )


class DeploymentController:
    """Keeps `spec.replicas` pods of each Deployment's current template; reports status."""

    def __init__(self, api, node: str):
        self.api, self.node = api, node

    def sync(self) -> None:
        pods = self.api.list("Pod")
        for dep in self.api.list("Deployment"):
            uid = dep["metadata"]["uid"]
            owned = [  # terminating pods count no more, as for a ReplicaSet
                p
                for p in pods
                if any(o.get("uid") == uid for o in p["metadata"].get("ownerReferences") or [])
                and not p["metadata"].get("deletionTimestamp")
            ]
            self._sync_one(dep, owned)

    def _sync_one(self, dep: dict, pods: list[dict]) -> None:
        spec, meta = dep["spec"], dep["metadata"]
        want = int(spec.get("replicas", 1))
        current_hash = template_hash(spec["template"])
        current = [p for p in pods if p["metadata"]["labels"].get(TEMPLATE_HASH) == current_hash]
        old = [p for p in pods if p not in current]
        recreate = (spec.get("strategy") or {}).get("type") == "Recreate"
        if old and (recreate or sum(map(pod_ready, current)) >= want):
            for p in old:
                self.api.delete("Pod", meta["namespace"], p["metadata"]["name"])
        if not (recreate and old):
            for _ in range(want - len(current)):
                self._create_pod(dep, current_hash)
        if len(current) > want:  # scale down: not-ready first, then newest first
            newest_first = sorted(
                current, key=lambda p: p["metadata"].get("creationTimestamp", ""), reverse=True
            )
            doomed = sorted(newest_first, key=pod_ready)[: len(current) - want]
            for p in doomed:
                self.api.delete("Pod", meta["namespace"], p["metadata"]["name"])
        ready = sum(map(pod_ready, pods))
        status = {
            "observedGeneration": meta.get("generation"),
            "replicas": len(pods),
            "updatedReplicas": len(current),
            "readyReplicas": ready,
            "availableReplicas": ready,
            "unavailableReplicas": max(0, want - ready),
        }
        if {k: (dep.get("status") or {}).get(k) for k in status} != status:
            self.api.patch(
                "Deployment", meta["namespace"], meta["name"], {"status": status}, "status"
            )

    def _create_pod(self, dep: dict, pod_hash: str) -> None:
        meta, template = dep["metadata"], dep["spec"]["template"]
        namespace = meta["namespace"]
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": f"{meta['name']}-{pod_hash}-{uuid.uuid4().hex[:5]}",
                "namespace": namespace,
                "labels": {**(template["metadata"].get("labels") or {}), TEMPLATE_HASH: pod_hash},
                "annotations": dict(template["metadata"].get("annotations") or {}),
                "ownerReferences": [
                    {
                        "apiVersion": "apps/v1",
                        "kind": "Deployment",
                        "name": meta["name"],
                        "uid": meta["uid"],
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            },
            "spec": json.loads(json.dumps(template["spec"])),
        }
        spec = pod["spec"]
        spec["nodeName"] = self.node  # the scheduler's job: one node, no constraints
        spec.setdefault("restartPolicy", "Always")
        account = spec.setdefault("serviceAccountName", "default")
        added = podspec.service_account_volume(
            pod, self.api.get("ServiceAccount", namespace, account)
        )
        if added is not None:  # what the ServiceAccount admission plugin adds
            volume, mount = added
            spec.setdefault("volumes", []).append(volume)
            for c in spec["containers"]:
                c.setdefault("volumeMounts", []).append(dict(mount))
        self.api.create("Pod", namespace, pod)


class ServiceController:
    """ClusterIPs, EndpointSlices, the userspace proxy and per-pod hosts files."""

    def __init__(self, api, network, proxy, kubelet, api_tls):
        self.api, self.network, self.proxy, self.kubelet = api, network, proxy, kubelet
        self.api_tls = api_tls  # (ssl context, emulator port) for the `kubernetes` Service
        self.ips: dict[tuple[str, str], str] = {}
        self._lock = threading.Lock()

    def sync(self) -> None:
        with self._lock:
            services = self.api.list("Service")
            pods = [p for p in self.api.list("Pod") if not p["metadata"].get("deletionTimestamp")]
            hosts: dict[str, list[str]] = {}
            wanted_ports = set()
            for svc in services:
                svc = self._allocate(svc)
                endpoints = self._endpoints(svc, pods)
                wanted_ports |= self._proxy(svc, endpoints)
                self._hosts_entries(svc, endpoints, hosts)
            for ip, port in self.proxy.ports() - wanted_ports:
                self.proxy.remove(ip, port)
            self._write_hosts(hosts)

    def _allocate(self, svc: dict) -> dict:
        meta, spec = svc["metadata"], svc["spec"]
        if spec.get("clusterIP") and spec["clusterIP"] != "":
            self.ips.setdefault((meta["namespace"], meta["name"]), spec["clusterIP"])
            return svc
        key = (meta["namespace"], meta["name"])
        if key not in self.ips:
            self.ips[key] = self.network.service_ip()
        patch = {"spec": {"clusterIP": self.ips[key], "clusterIPs": [self.ips[key]]}}
        return self.api.patch("Service", meta["namespace"], meta["name"], patch)

    def _endpoints(self, svc: dict, pods: list[dict]) -> list[dict]:
        """Maintain the Service's EndpointSlice; returns its endpoints with resolved ports."""
        meta, spec = svc["metadata"], svc["spec"]
        selector = spec.get("selector") or {}
        if not selector:
            return []
        chosen = [
            p
            for p in pods
            if p["metadata"]["namespace"] == meta["namespace"]
            and matches(selector, p["metadata"].get("labels"))
            and (p.get("status") or {}).get("podIP")
        ]
        endpoints = []
        for p in sorted(chosen, key=lambda p: p["metadata"]["name"]):
            ready = pod_ready(p) or bool(spec.get("publishNotReadyAddresses"))
            ports = {}
            for sp in spec.get("ports") or []:
                target = sp.get("targetPort", sp["port"])
                container = p["spec"]["containers"][0]
                try:
                    ports[sp.get("name") or ""] = (sp["port"], resolve_port(container, target))
                except ValueError:
                    continue
            endpoints.append({"pod": p, "ip": p["status"]["podIP"], "ready": ready, "ports": ports})
        self._write_slice(svc, endpoints)
        return endpoints

    def _write_slice(self, svc: dict, endpoints: list[dict]) -> None:
        meta = svc["metadata"]
        first = endpoints[0]["ports"] if endpoints else {}
        body = {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": f"{meta['name']}-e2e",
                "namespace": meta["namespace"],
                "labels": {
                    "kubernetes.io/service-name": meta["name"],
                    "endpointslice.kubernetes.io/managed-by": "e2e-harness",
                },
                "ownerReferences": [
                    {
                        "apiVersion": "v1",
                        "kind": "Service",
                        "name": meta["name"],
                        "uid": meta["uid"],
                        "controller": True,
                    }
                ],
            },
            "addressType": "IPv4",
            "endpoints": [
                {
                    "addresses": [e["ip"]],
                    "conditions": {
                        "ready": e["ready"],
                        "serving": e["ready"],
                        "terminating": False,
                    },
                    "nodeName": e["pod"]["spec"].get("nodeName"),
                    "targetRef": {
                        "kind": "Pod",
                        "name": e["pod"]["metadata"]["name"],
                        "namespace": meta["namespace"],
                        "uid": e["pod"]["metadata"]["uid"],
                    },
                }
                for e in endpoints
            ],
            "ports": [
                {"name": name, "port": target, "protocol": "TCP"}
                for name, (_, target) in sorted(first.items())
            ],
        }
        live = self.api.get("EndpointSlice", meta["namespace"], body["metadata"]["name"])
        if live is None:
            self.api.create("EndpointSlice", meta["namespace"], body)
        elif any(live.get(k) != body[k] for k in ("endpoints", "ports")):
            self.api.patch(
                "EndpointSlice",
                meta["namespace"],
                body["metadata"]["name"],
                {"endpoints": body["endpoints"], "ports": body["ports"]},
            )

    def _proxy(self, svc: dict, endpoints: list[dict]) -> set[tuple[str, int]]:
        spec, meta = svc["spec"], svc["metadata"]
        ip = spec.get("clusterIP")
        if not ip or ip == "None":
            return set()
        served = set()
        if (meta["namespace"], meta["name"]) == ("default", "kubernetes"):
            tls, api_port = self.api_tls
            self.proxy.set_backends(ip, 443, [("127.0.0.1", api_port)], tls=tls)
            return {(ip, 443)}
        for sp in spec.get("ports") or []:
            backends = [
                (e["ip"], e["ports"][sp.get("name") or ""][1])
                for e in endpoints
                if e["ready"] and (sp.get("name") or "") in e["ports"]
            ]
            self.proxy.set_backends(ip, sp["port"], backends)
            served.add((ip, sp["port"]))
        return served

    def _hosts_entries(self, svc: dict, endpoints: list[dict], hosts: dict) -> None:
        """Cluster DNS as hosts entries: a ClusterIP Service resolves to its cluster IP, a
        headless one to every ready pod IP. Keyed by namespace: (address, short name)."""
        meta, spec = svc["metadata"], svc["spec"]
        if spec.get("clusterIP") == "None":
            addresses = [e["ip"] for e in endpoints if e["ready"]]
        else:
            addresses = [spec["clusterIP"]]
        entries = hosts.setdefault(meta["namespace"], [])
        entries += [(addr, meta["name"]) for addr in addresses]

    def _write_hosts(self, hosts: dict[str, list[tuple[str, str]]]) -> None:
        """Each pod's /etc/hosts: itself, then Services (short names in its own namespace)."""
        for runtime in list(self.kubelet.pods.values()):
            lines = [
                "127.0.0.1\tlocalhost",
                "::1\tlocalhost ip6-localhost ip6-loopback",
                f"{runtime.ip}\t{runtime.name}",
            ]
            for ns, entries in sorted(hosts.items()):
                for addr, name in entries:
                    qualified = f"{name}.{ns} {name}.{ns}.svc {name}.{ns}.svc.cluster.local"
                    short = f"{name} " if ns == runtime.namespace else ""
                    lines.append(f"{addr}\t{short}{qualified}")
            self.network.set_hosts(runtime.netns, "\n".join(lines) + "\n")
