"""Pure builders for the engine side: the pool ConfigMap, per-role Deployments and headless
Services (the pod contract is in docs/operator.md)."""

from __future__ import annotations

import json
import math

from epdserve.operator import kvevents, lora, meta, parallel, prompt_key, source, tenancy
from epdserve.operator.gpu import device_env
from epdserve.operator.spec import SERVE_ROLE, PoolSpec
from epdserve.operator.transfer import ec_transfer_config, kv_events_config, kv_transfer_config


def build_config_map(pool: PoolSpec) -> dict:
    """`<pool>-config`: the connector configs of every role and the hash seed."""
    data = {"hash-seed": pool.hash_seed, "model": pool.model_arg}
    data |= lora.config_data(pool.lora, model_claim(pool))
    for role in pool.roles:
        if (kv := kv_transfer_config(pool, role)) is not None:
            data[f"kv-transfer-{role}.json"] = json.dumps(kv, sort_keys=True)
        if (ec := ec_transfer_config(pool, role)) is not None:
            data[f"ec-transfer-{role}.json"] = json.dumps(ec, sort_keys=True)
    return meta.stamp(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": meta.metadata(pool, meta.name_of(pool, "config"), "config"),
            "data": data,
        }
    )


def _from_config(name: str, config_map: str, key: str) -> dict:
    return {"name": name, "valueFrom": {"configMapKeyRef": {"name": config_map, "key": key}}}


def redis_password_env(pool: PoolSpec) -> list[dict]:
    """EPDSERVE_REDIS_PASSWORD from the referenced or the generated Secret (if any)."""
    if pool.cache.backend != "redis":
        return []
    if pool.cache.redis_managed:
        secret, key = meta.name_of(pool, "redis"), "password"
    elif pool.cache.redis_secret:
        secret, key = pool.cache.redis_secret
    else:
        return []
    return [
        {
            "name": "EPDSERVE_REDIS_PASSWORD",
            "valueFrom": {"secretKeyRef": {"name": secret, "key": key}},
        }
    ]


def api_key_env(pool: PoolSpec) -> list[dict]:
    """EPDSERVE_API_KEY from the router's API-key Secret (router and engines share it, so an
    engine accepts the Authorization header the router forwards)."""
    if pool.router.api_key_secret is None:
        return []
    secret, key = pool.router.api_key_secret
    return [
        {"name": "EPDSERVE_API_KEY", "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}
    ]


def downward_env() -> list[dict]:
    """POD_IP / POD_NAME / POD_NAMESPACE from the downward API (POD_IP first: others expand it)."""
    fields = (("POD_IP", "status.podIP"), ("POD_NAME", "metadata.name"))
    fields += (("POD_NAMESPACE", "metadata.namespace"),)
    return [{"name": n, "valueFrom": {"fieldRef": {"fieldPath": f}}} for n, f in fields]


def engine_env(pool: PoolSpec, role: str) -> list[dict]:
    """The environment of an engine container of `role` (the pod contract)."""
    config_map = meta.name_of(pool, "config")
    env = downward_env() + kvevents.engine_env(pool, role)
    env += [
        {"name": "EPDSERVE_POOL", "value": pool.name},
        _from_config("EPDSERVE_HASH_SEED", config_map, "hash-seed"),
        {"name": "HOME", "value": "/tmp"},
        {"name": "HF_HOME", "value": source.HF_HOME},
    ]
    env += source.offline_env(pool.model_hf) + device_env(pool, role)
    if pool.kv_events and role != "encoder":  # encoder pods hold no KV cache
        env.append(
            {"name": "EPDSERVE_KV_EVENTS_CONFIG", "value": json.dumps(kv_events_config(pool))}
        )
    if kv_transfer_config(pool, role) is not None:
        key = f"kv-transfer-{role}.json"
        env.append(_from_config("EPDSERVE_KV_TRANSFER_CONFIG", config_map, key))
    if ec_transfer_config(pool, role) is not None:
        key = f"ec-transfer-{role}.json"
        env.append(_from_config("EPDSERVE_EC_TRANSFER_CONFIG", config_map, key))
    env += redis_password_env(pool) + api_key_env(pool) + prompt_key.key_env(pool)
    env += lora.list_env(pool.lora, config_map, role)
    env += [{"name": f"EPDSERVE_{k}", "value": str(v)} for k, v in sorted(pool.tuning.items())]
    user = [dict(e) for e in pool.roles[role].env]
    return env + parallel.engine_env(pool, role, user) + user


def engine_command(pool: PoolSpec, role: str) -> list[str]:
    """`epdserve serve MODEL --role ...` plus the role's extra args."""
    return [
        "epdserve",
        "serve",
        pool.model_arg,
        "--role",
        SERVE_ROLE[role],
        "--host",
        "0.0.0.0",
        "--port",
        str(meta.HTTP_PORT),
        "--served-model-name",
        pool.served_name,
        *lora.engine_args(pool.lora, role, model_claim(pool)),
        *tenancy.engine_args(pool.router.tenancy, list(pool.roles[role].args)),
        *pool.roles[role].args,
    ]


def model_claim(pool: PoolSpec) -> str | None:
    """The model's PVC, if any (adapters on it are read through the /models mount)."""
    return pool.model_pvc[0] if pool.model_pvc else None


PRESTOP_SLEEP_S = 5  # time for EndpointSlices and the router to drop a terminating pod
DRAIN_TIMEOUT_S = 30.0  # `epdserve serve --drain-timeout` default
STOP_MARGIN_S = 15  # engine-core shutdown after the drain, before the kubelet's SIGKILL


def drain_timeout(pool: PoolSpec, role: str) -> float:
    """The pod's drain time: `--drain-timeout` in the role's args, else its env, else 30s
    (a value serve would refuse counts as the default: that pod never starts anyway)."""
    args = list(pool.roles[role].args)
    found = None
    for i, arg in enumerate(args):
        if arg == "--drain-timeout" and i + 1 < len(args):
            found = args[i + 1]
        elif arg.startswith("--drain-timeout="):
            found = arg.partition("=")[2]
    if found is None:
        env = {e.get("name"): e.get("value") for e in pool.roles[role].env}
        found = env.get("EPDSERVE_DRAIN_TIMEOUT")
    try:
        value = float(found) if found else DRAIN_TIMEOUT_S
    except ValueError:
        return DRAIN_TIMEOUT_S
    return value if 0 <= value < math.inf else DRAIN_TIMEOUT_S


def graceful_stop(pool: PoolSpec, role: str) -> tuple[dict, int]:
    """(container lifecycle, terminationGracePeriodSeconds) of a scale-down: the preStop
    sleep runs while the pod leaves the Service and the router; then SIGTERM drains it."""
    lifecycle = {"preStop": {"sleep": {"seconds": PRESTOP_SLEEP_S}}}
    grace = PRESTOP_SLEEP_S + math.ceil(drain_timeout(pool, role)) + STOP_MARGIN_S
    return lifecycle, grace


def model_volumes(pool: PoolSpec) -> tuple[list[dict], list[dict]]:
    """(volumes, mounts) for the model PVC (read-only at /models), when the model is on one."""
    if not pool.model_pvc:
        return [], []
    claim = {"claimName": pool.model_pvc[0], "readOnly": True}
    volume = {"name": "model", "persistentVolumeClaim": claim}
    return [volume], [{"name": "model", "mountPath": "/models", "readOnly": True}]


def _volumes(pool: PoolSpec, role: str) -> tuple[list[dict], list[dict]]:
    shm_volume, shm_mount = parallel.shm_volume(pool, role)
    volumes = [{"name": "tmp", "emptyDir": {}}, source.cache_volume(pool.model_hf), shm_volume]
    mounts = [{"name": "tmp", "mountPath": "/tmp"}, source.cache_mount(), shm_mount]
    model_vols, model_mounts = model_volumes(pool)
    volumes += model_vols
    mounts += model_mounts
    if pool.cache.backend == "sharedStorage":
        claim = {"claimName": pool.cache.storage_claim}
        volumes.append({"name": "shared-cache", "persistentVolumeClaim": claim})
        mounts.append({"name": "shared-cache", "mountPath": pool.cache.storage_path})
    curve_vols, curve_mounts = kvevents.engine_volumes(pool, role)
    lora_vols, lora_mounts = lora.engine_volumes(pool.lora, role, model_claim(pool))
    return volumes + curve_vols + lora_vols, mounts + curve_mounts + lora_mounts


def _ports(pool: PoolSpec, role: str) -> list[dict]:
    ports = [{"name": "http", "containerPort": meta.HTTP_PORT, "protocol": "TCP"}]
    if pool.kv_events and role != "encoder":
        ports.append({"name": "kv-events", "containerPort": meta.EVENTS_PORT, "protocol": "TCP"})
        ports.append({"name": "kv-replay", "containerPort": meta.REPLAY_PORT, "protocol": "TCP"})
    return ports


def build_engine_deployment(pool: PoolSpec, role: str, config_hash: str = "") -> dict:
    """The Deployment `<pool>-<role>` running `epdserve serve --role ...`."""
    spec = pool.roles[role]
    selector = {meta.POOL_LABEL: pool.name, meta.ROLE_LABEL: role}
    volumes, mounts = _volumes(pool, role)
    lifecycle, grace = graceful_stop(pool, role)
    container = {
        "name": "engine",
        "image": pool.image,
        "imagePullPolicy": pool.pull_policy,
        "command": engine_command(pool, role),
        "env": engine_env(pool, role),
        "ports": _ports(pool, role),
        "resources": dict(spec.resources),
        "volumeMounts": mounts,
        "securityContext": meta.container_security_context(),
        "startupProbe": meta.http_probe("/health", period=10, failures=90),
        "livenessProbe": meta.http_probe("/health", period=10, failures=3),
        "readinessProbe": meta.http_probe("/ready", period=5, failures=3),
        "lifecycle": lifecycle,
    }
    pod_spec = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,  # a Service named epdserve would inject EPDSERVE_PORT
        "securityContext": meta.pod_security_context(),
        "containers": [container],
        "volumes": volumes,
        "terminationGracePeriodSeconds": grace,
    }
    inits = lora.init_containers(pool.lora, role, pool.image, pool.pull_policy)
    if pool.model_hf:
        inits.insert(0, source.download_init_container(pool.image, pool.pull_policy, pool.model_hf))
    if inits:
        pod_spec["initContainers"] = inits
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in spec.tolerations]
    if pool.pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s} for s in pool.pull_secrets]
    template_meta = {"labels": meta.labels(pool, "engine", role)}
    if config_hash:
        template_meta["annotations"] = {meta.CONFIG_HASH_ANNOTATION: config_hash}
    return meta.stamp(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": meta.metadata(pool, meta.name_of(pool, role), "engine", role),
            "spec": {
                "replicas": spec.replicas,
                "selector": {"matchLabels": selector},
                "strategy": {"type": "RollingUpdate"},
                "template": {"metadata": template_meta, "spec": pod_spec},
            },
        }
    )


def build_role_service(pool: PoolSpec, role: str) -> dict:
    """Headless Service `<pool>-<role>`: DNS/EndpointSlice discovery of one role's pods."""
    ports = [
        {"name": p["name"], "port": p["containerPort"], "targetPort": p["name"], "protocol": "TCP"}
        for p in _ports(pool, role)
    ]
    return meta.stamp(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": meta.metadata(pool, meta.name_of(pool, role), "engine", role),
            "spec": {
                "clusterIP": "None",
                # publishNotReadyAddresses stays unset (false): the API server stores a false
                # plain bool as absent, so sending it would read as drift on every pass.
                "selector": {meta.POOL_LABEL: pool.name, meta.ROLE_LABEL: role},
                "ports": ports,
            },
        }
    )
