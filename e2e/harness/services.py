"""What runs on a node besides the kubelet, for Services: kube-proxy (here a userspace proxy,
svcproxy.py) and cluster DNS (here each pod's hosts file). Both follow the real API: cluster
IPs come from the API server's allocator, endpoints from the controller manager's
EndpointSlice controller. A level-triggered `sync()` over the API's current state, run in a
loop.
"""

from __future__ import annotations

import threading

SERVICE_NAME = "kubernetes.io/service-name"


class ServiceRouting:
    """Proxy listeners for every ClusterIP Service port; hosts entries for every Service."""

    def __init__(self, api, network, proxy, kubelet):
        self.api, self.network, self.proxy, self.kubelet = api, network, proxy, kubelet
        self.addresses: set[str] = set()  # cluster IPs added to the bridge
        self._lock = threading.Lock()

    def sync(self) -> None:
        with self._lock:
            slices: dict[tuple[str, str], list[dict]] = {}
            for s in self.api.list("EndpointSlice"):
                owner = (s["metadata"].get("labels") or {}).get(SERVICE_NAME)
                if owner:
                    slices.setdefault((s["metadata"]["namespace"], owner), []).append(s)
            hosts: dict[str, list[tuple[str, str]]] = {}
            wanted = set()
            for svc in self.api.list("Service"):
                meta = svc["metadata"]
                endpoints = ready_endpoints(slices.get((meta["namespace"], meta["name"]), []))
                wanted |= self._proxy(svc, endpoints)
                self._hosts_entries(svc, endpoints, hosts)
            for ip, port in self.proxy.ports() - wanted:
                self.proxy.remove(ip, port)
            self._write_hosts(hosts)

    def _proxy(self, svc: dict, endpoints: list[tuple[str, dict]]) -> set[tuple[str, int]]:
        ip = svc["spec"].get("clusterIP")
        if not ip or ip == "None":
            return set()
        if ip not in self.addresses:
            self.network.add_service_ip(ip)
            self.addresses.add(ip)
        served = set()
        for sp in svc["spec"].get("ports") or []:
            name = sp.get("name") or ""
            backends = [(addr, ports[name]) for addr, ports in endpoints if name in ports]
            where = f"{svc['metadata']['namespace']}/{svc['metadata']['name']}:{sp['port']}"
            self.proxy.set_backends(ip, sp["port"], backends, name=where)
            served.add((ip, sp["port"]))
        return served

    def _hosts_entries(self, svc: dict, endpoints, hosts: dict) -> None:
        """Cluster DNS as hosts entries: a ClusterIP Service resolves to its cluster IP, a
        headless one to every ready endpoint. Keyed by namespace: (address, short name)."""
        meta, spec = svc["metadata"], svc["spec"]
        if spec.get("clusterIP") == "None":
            addresses = sorted({addr for addr, _ in endpoints})
        elif spec.get("clusterIP"):
            addresses = [spec["clusterIP"]]
        else:
            return
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


def ready_endpoints(slices: list[dict]) -> list[tuple[str, dict]]:
    """[(address, {port name: port})] of the slices' ready endpoints, sorted by address."""
    found = []
    for s in slices:
        ports = {p.get("name") or "": p["port"] for p in s.get("ports") or [] if p.get("port")}
        for e in s.get("endpoints") or []:
            if (e.get("conditions") or {}).get("ready") is False:
                continue
            found += [(addr, ports) for addr in e.get("addresses") or []]
    return sorted(found, key=lambda item: item[0])
