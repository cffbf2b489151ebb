"""Pure builders for the router: its RBAC, Deployment, the endpoint Service, ServiceMonitor."""

from __future__ import annotations

from epdserve.operator import kvevents, lora, meta, prompt_key, source, tenancy
from epdserve.operator.engine import api_key_env, downward_env, model_claim, model_volumes
from epdserve.operator.kube import ApiError, Kube
from epdserve.operator.spec import PoolSpec

# What the router may do with the API: find the pool's pods (namespaced, read-only).
ROUTER_RULES = [
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
    {
        "apiGroups": ["discovery.k8s.io"],
        "resources": ["endpointslices"],
        "verbs": ["get", "list", "watch"],
    },
]

# Every scraped series gets `pool` and `role` (router pods: role="router"), so dashboards and
# alerts select a pool's pods by those (the chart's ServiceMonitor adds the same two).
TARGET_RELABELINGS = [
    {"sourceLabels": ["__meta_kubernetes_service_label_epdserve_io_pool"], "targetLabel": "pool"},
    {"sourceLabels": ["__meta_kubernetes_pod_label_epdserve_io_role"], "targetLabel": "role"},
]


def endpoint_url(pool: PoolSpec) -> str:
    """The pool's OpenAI endpoint inside the cluster."""
    host = f"{meta.name_of(pool, '')}.{pool.namespace}.svc"
    return f"http://{host}:{pool.router.service_port}"


def endpoint_waiting(kube: Kube, pool: PoolSpec) -> str:
    """What Ready still waits for once every Deployment is ready: the pool's Service must
    list a ready router endpoint, else a client told Ready meets a Service that refuses
    connections (its endpoints trail the Deployment's status). '' when it does, or when the
    cluster serves no EndpointSlices (nothing to wait for)."""
    service = meta.name_of(pool, "")
    selector = f"kubernetes.io/service-name={service}"
    try:
        slices = kube.list("discovery.k8s.io/v1", "EndpointSlice", pool.namespace, selector)
    except ApiError as exc:
        if exc.status in (403, 404):
            return ""
        raise
    for piece in slices:
        for endpoint in piece.get("endpoints") or []:
            ready = (endpoint.get("conditions") or {}).get("ready")  # unset reads as ready
            if endpoint.get("addresses") and ready is not False:
                return ""
    return f"waiting for Service {service} to list a ready router endpoint"


def router_selector(pool: PoolSpec) -> dict[str, str]:
    """Router pods carry `epdserve.io/router`, not `epdserve.io/pool`, so their own
    discovery selector (`epdserve.io/pool=POOL`) finds engine pods only."""
    return {meta.ROUTER_LABEL: pool.name}


def build_router_service_account(pool: PoolSpec) -> dict:
    """ServiceAccount `<pool>-router`."""
    return meta.stamp(
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": meta.metadata(pool, meta.name_of(pool, "router"), "router"),
            "automountServiceAccountToken": True,
        }
    )


def build_router_role(pool: PoolSpec) -> dict:
    """Role `<pool>-router`: namespaced read access to pods and EndpointSlices."""
    return meta.stamp(
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": meta.metadata(pool, meta.name_of(pool, "router"), "router"),
            "rules": [dict(r) for r in ROUTER_RULES],
        }
    )


def build_router_role_binding(pool: PoolSpec) -> dict:
    """RoleBinding of the router Role to the router ServiceAccount."""
    name = meta.name_of(pool, "router")
    return meta.stamp(
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": meta.metadata(pool, name, "router"),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": pool.namespace}],
        }
    )


def router_command(pool: PoolSpec) -> list[str]:
    """`epdserve router ...` as the pod contract fixes it."""
    return [
        "epdserve",
        "router",
        "--host",
        "0.0.0.0",
        "--port",
        str(meta.HTTP_PORT),
        "--model",
        source.ROUTER_MODEL_LINK if pool.model_hf else pool.model_arg,
        "--served-model-name",
        pool.served_name,
        "--strategy",
        pool.router.strategy,
        "--discovery",
        "k8s",
        "--namespace",
        pool.namespace,
        "--selector",
        f"{meta.POOL_LABEL}={pool.name}",
        "--kv-events-port",
        str(meta.EVENTS_PORT),
        "--kv-replay-port",
        str(meta.REPLAY_PORT),
        *kvevents.router_args(pool),
        *lora.router_args(pool.lora, model_claim(pool)),
        *tenancy.router_args(pool.router.tenancy),
    ]


def build_router_deployment(pool: PoolSpec) -> dict:
    """Deployment `<pool>-router`: the cache-aware gateway in front of the engine pods."""
    router = pool.router
    model_vols, model_mounts = model_volumes(pool)
    curve_vols, curve_mounts = kvevents.router_volumes(pool)
    tenant_vols, tenant_mounts = tenancy.router_volumes(router.tenancy)
    container = {
        "name": "router",
        "image": router.image,
        "imagePullPolicy": pool.pull_policy,
        "command": router_command(pool),
        "env": downward_env()
        + [
            {"name": "EPDSERVE_POOL", "value": pool.name},
            {"name": "HOME", "value": "/tmp"},
            {"name": "HF_HOME", "value": source.HF_HOME},
        ]
        + api_key_env(pool)
        + prompt_key.key_env(pool),
        "ports": [{"name": "http", "containerPort": meta.HTTP_PORT, "protocol": "TCP"}],
        "resources": dict(router.resources),
        "volumeMounts": [
            {"name": "tmp", "mountPath": "/tmp"},
            source.cache_mount(),
            *model_mounts,
            *curve_mounts,
            *tenant_mounts,
        ],
        "securityContext": meta.container_security_context(),
        "livenessProbe": meta.http_probe("/health", period=10, failures=3, initial=5),
        "readinessProbe": meta.http_probe("/ready", period=5, failures=3),
    }
    pod_spec = {
        "serviceAccountName": meta.name_of(pool, "router"),
        "enableServiceLinks": False,
        "securityContext": meta.pod_security_context(),
        "containers": [container],
        "volumes": [
            {"name": "tmp", "emptyDir": {}},
            source.cache_volume(pool.model_hf),
            *model_vols,
            *curve_vols,
            *tenant_vols,
        ],
    }
    if pool.model_hf:  # the engine image downloads (the router image may lack the hub client)
        link = source.ROUTER_MODEL_LINK
        init = source.download_init_container(pool.image, pool.pull_policy, pool.model_hf, link)
        pod_spec["initContainers"] = [init]
    if router.node_selector:
        pod_spec["nodeSelector"] = dict(router.node_selector)
    if router.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in router.tolerations]
    if pool.pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s} for s in pool.pull_secrets]
    pod_labels = {**router_selector(pool), meta.ROLE_LABEL: "router"}
    pod_labels["app.kubernetes.io/name"] = "epdserve"
    pod_labels["app.kubernetes.io/component"] = "router"
    return meta.stamp(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": meta.metadata(pool, meta.name_of(pool, "router"), "router", "router"),
            "spec": {
                "replicas": router.replicas,
                "selector": {"matchLabels": router_selector(pool)},
                "template": {"metadata": {"labels": pod_labels}, "spec": pod_spec},
            },
        }
    )


def build_router_service(pool: PoolSpec) -> dict:
    """Service `<pool>`: the pool's endpoint (ClusterIP unless the spec asks otherwise)."""
    port = {"name": "http", "port": pool.router.service_port, "targetPort": "http"}
    port["protocol"] = "TCP"
    return meta.stamp(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": meta.metadata(pool, meta.name_of(pool, ""), "router", "router"),
            "spec": {
                "type": pool.router.service_type,
                "selector": router_selector(pool),
                "ports": [port],
            },
        }
    )


def build_service_monitor(pool: PoolSpec) -> dict | None:
    """A prometheus-operator ServiceMonitor scraping engine and router `/metrics`."""
    if pool.service_monitor is None:
        return None
    obj_meta = meta.metadata(pool, meta.name_of(pool, "metrics"), "metrics")
    obj_meta["labels"].update(pool.service_monitor["labels"])
    endpoint = {"port": "http", "path": "/metrics", "interval": pool.service_monitor["interval"]}
    endpoint["relabelings"] = [dict(r) for r in TARGET_RELABELINGS]
    return meta.stamp(
        {
            "apiVersion": "monitoring.coreos.com/v1",
            "kind": "ServiceMonitor",
            "metadata": obj_meta,
            "spec": {
                "selector": {"matchLabels": {meta.POOL_LABEL: pool.name}},
                "namespaceSelector": {"matchNames": [pool.namespace]},
                "endpoints": [endpoint],
            },
        }
    )
