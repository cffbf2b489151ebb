"""The kubelet's node object: it registers its Node (capacity, addresses, Ready) and keeps
its Lease in `kube-node-lease` renewed, as a kubelet does, so the real node lifecycle
controller keeps it Ready and the real scheduler places pods on it.

Capacity is what pods may ask of this machine's stand-in node: the examples request GPUs
and several CPUs, which the e2e kubelet does not enforce (pods are processes here).
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

from kapi import ApiError

KUBELET_VERSION = "v1.37.2"
CAPACITY = {
    "cpu": "64",
    "memory": "256Gi",
    "pods": "110",
    "ephemeral-storage": "100Gi",
    "nvidia.com/gpu": "8",
}
LEASE_SECONDS = 40
RENEW_EVERY = 5.0


def now(micro: bool = False) -> str:
    fmt = "%Y-%m-%dT%H:%M:%S.%fZ" if micro else "%Y-%m-%dT%H:%M:%SZ"
    return datetime.now(UTC).strftime(fmt)


class NodeAgent:
    """register() once; heartbeat() on every kubelet sync (renews at most every 5 s)."""

    def __init__(self, api, name: str, address: str):
        self.api, self.name, self.address = api, name, address
        self._last = 0.0
        self._since = now()

    def register(self) -> None:
        body = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.name,
                "labels": {
                    "kubernetes.io/hostname": self.name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                },
            },
        }
        try:
            self.api.create("Node", None, body)
        except ApiError as exc:
            if exc.status != 409:  # registered before (a restarted kubelet)
                raise
        self._last = 0.0
        self.heartbeat()

    def heartbeat(self) -> None:
        if time.monotonic() - self._last < RENEW_EVERY:
            return
        stamp = now()
        status = {
            "capacity": CAPACITY,
            "allocatable": CAPACITY,
            "addresses": [
                {"type": "InternalIP", "address": self.address},
                {"type": "Hostname", "address": self.name},
            ],
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "KubeletReady",
                    "message": "e2e kubelet is posting ready status",
                    "lastHeartbeatTime": stamp,
                    "lastTransitionTime": self._since,
                }
            ],
            "nodeInfo": {
                "kubeletVersion": KUBELET_VERSION,
                "kubeProxyVersion": "",
                "operatingSystem": "linux",
                "architecture": "amd64",
                "containerRuntimeVersion": "e2e://processes",
                "osImage": "e2e",
                "kernelVersion": "",
                "machineID": "",
                "systemUUID": "",
                "bootID": "",
            },
        }
        self.api.patch("Node", None, self.name, {"status": status}, "status")
        self._renew_lease()
        self._last = time.monotonic()

    def _renew_lease(self) -> None:
        spec = {
            "holderIdentity": self.name,
            "leaseDurationSeconds": LEASE_SECONDS,
            "renewTime": now(micro=True),
        }
        if self.api.get("Lease", "kube-node-lease", self.name) is None:
            body = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": self.name, "namespace": "kube-node-lease"},
                "spec": spec,
            }
            self.api.create("Lease", "kube-node-lease", body)
        else:
            self.api.patch("Lease", "kube-node-lease", self.name, {"spec": spec})
