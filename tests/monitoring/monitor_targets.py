"""What prometheus-operator makes of a ServiceMonitor over a pool's objects: the scrape targets
and the labels its generated relabeling gives them (role `endpoints`, `honorLabels: false`).

The rules follow prometheus-operator's generated scrape config: a Service is kept when its
namespace and labels match the monitor, an endpoint port by its Service port *name*; the target
is each pod behind that Service whose container port the Service port's `targetPort` resolves
to; the labels are `namespace`, `service`, `pod`, `container`, `endpoint` (the port name) and
`job` (the Service name), then the endpoint's own `relabelings` (action `replace` over
`__meta_kubernetes_{service,pod}_label_*`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    deployment: str  # the Deployment whose pod this is
    port: int  # the container port scraped
    path: str
    labels: tuple[tuple[str, str], ...]


def service_monitor(objects: list[dict]) -> dict:
    """The one ServiceMonitor among a pool's objects."""
    (monitor,) = [o for o in objects if o["kind"] == "ServiceMonitor"]
    return monitor


def selects(selector: dict, labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels + matchExpressions) against labels."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": labels.get(key) not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def _namespace_ok(monitor: dict, namespace: str) -> bool:
    chosen = monitor["spec"].get("namespaceSelector", {})
    if chosen.get("any"):
        return True
    return namespace in chosen.get("matchNames", [monitor["metadata"]["namespace"]])


def _sanitize(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def _meta_labels(service: dict, pod_labels: dict[str, str]) -> dict[str, str]:
    out = {
        f"__meta_kubernetes_service_label_{_sanitize(k)}": v
        for k, v in service["metadata"].get("labels", {}).items()
    }
    out.update({f"__meta_kubernetes_pod_label_{_sanitize(k)}": v for k, v in pod_labels.items()})
    return out


def _relabel(labels: dict[str, str], meta: dict[str, str], rules: list[dict]) -> None:
    for rule in rules:
        action = rule.get("action", "replace")
        assert action == "replace", f"relabel action {action!r} is not simulated"
        assert rule.get("regex", "(.*)") == "(.*)", "only the default regex is simulated"
        value = rule.get("separator", ";").join(
            meta.get(s, labels.get(s, "")) for s in rule["sourceLabels"]
        )
        replacement = rule.get("replacement", "$1").replace("$1", value).replace("${1}", value)
        if replacement:  # Prometheus drops the write of an empty value
            labels[rule["targetLabel"]] = replacement


def _container_port(deployment: dict, target_port) -> tuple[str, int] | None:
    for container in deployment["spec"]["template"]["spec"]["containers"]:
        for port in container.get("ports", []):
            if target_port in (port.get("name"), port["containerPort"]):
                return container["name"], port["containerPort"]
    return None


def monitor_targets(monitor: dict, objects: list[dict]) -> list[Target]:
    """Every target `monitor` gives Prometheus over `objects` (one pod per Deployment,
    named `<deployment>-0`)."""
    services = [
        o
        for o in objects
        if o["kind"] == "Service"
        and _namespace_ok(monitor, o["metadata"]["namespace"])
        and selects(monitor["spec"]["selector"], o["metadata"].get("labels", {}))
    ]
    deployments = [o for o in objects if o["kind"] == "Deployment"]
    targets = []
    for service in services:
        for endpoint in monitor["spec"]["endpoints"]:
            ports = [p for p in service["spec"]["ports"] if p.get("name") == endpoint["port"]]
            for port, deployment in (
                (p, d)
                for p in ports
                for d in deployments
                if d["metadata"]["namespace"] == service["metadata"]["namespace"]
                and selects(
                    {"matchLabels": service["spec"]["selector"]},
                    d["spec"]["template"]["metadata"]["labels"],
                )
            ):
                found = _container_port(deployment, port.get("targetPort", port["port"]))
                if found is None:
                    continue  # prometheus-operator would find no endpoint address to scrape
                container, container_port = found
                name = service["metadata"]["name"]
                labels = {
                    "job": name,
                    "namespace": service["metadata"]["namespace"],
                    "service": name,
                    "pod": deployment["metadata"]["name"] + "-0",
                    "container": container,
                    "endpoint": endpoint["port"],
                }
                pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
                meta = _meta_labels(service, pod_labels)
                _relabel(labels, meta, endpoint.get("relabelings", []))
                path = endpoint.get("path", "/metrics")
                target = Target(
                    deployment["metadata"]["name"],
                    container_port,
                    path,
                    tuple(sorted(labels.items())),
                )
                targets.append(target)
    return targets
