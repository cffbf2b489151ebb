"""The InferencePool spec as a typed, validated value (pure: no API calls).

The CRD schema checks types, enums and minimums; :func:`parse_pool` checks what a schema
cannot say (which roles go together, which cache a role set needs) and raises
:class:`InvalidSpec` naming the field, before anything is built or applied. Sections with
rules of their own parse in their own modules: `spec.cache` (``cache_spec``),
`spec.autoscaling` (``autoscaling``), the GPU fields (``gpu``), a role's ranks (``parallel``),
the Hub source (``source``), `spec.lora` (``lora``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from epdserve.operator.autoscaling import (
    AutoscalingSpec,
    RoleAutoscaling,
    parse_autoscaling,
    parse_role_autoscaling,
)
from epdserve.operator.cache_spec import CacheSpec, parse_cache, validate_cache
from epdserve.operator.errors import InvalidSpec
from epdserve.operator.gpu import role_gpus, validate_device, with_gpus
from epdserve.operator.lora import LoraSpec, parse_lora
from epdserve.operator.parallel import (
    RoleParallel,
    parse_parallel,
    validate_parallel,
    with_rank_cpus,
)
from epdserve.operator.quantity import parse_bytes
from epdserve.operator.source import HubSource, parse_hub_source
from epdserve.operator.spec_fields import resources, secret_ref
from epdserve.operator.tenancy import TenancySpec, parse_tenancy

GROUP = "epdserve.io"
VERSION = "v1alpha1"
PLURAL = "inferencepools"
KIND = "InferencePool"

ROLES = ("colocated", "encoder", "prefill", "decode")
# role -> value of `epdserve serve --role`
SERVE_ROLE = {"colocated": "both", "encoder": "encoder", "prefill": "prefill", "decode": "decode"}
STRATEGIES = ("round-robin", "least-load", "prefix", "prefix+load", "prefix+cost")


@dataclass(frozen=True)
class RoleSpec:
    """One role's pods."""

    replicas: int = 1
    resources: dict = field(default_factory=dict)
    args: tuple[str, ...] = ()
    env: tuple[dict, ...] = ()
    node_selector: dict = field(default_factory=dict)
    tolerations: tuple[dict, ...] = ()
    gpus: int = 0  # nvidia.com/gpu per pod (from `gpus` or the resources)
    autoscaling: RoleAutoscaling | None = None  # None: a fixed `replicas`
    parallel: RoleParallel = field(default_factory=RoleParallel)  # tensor-parallel ranks


@dataclass(frozen=True)
class RouterSpec:
    """The router Deployment and the pool's endpoint Service."""

    replicas: int = 1
    strategy: str = "prefix+load"
    image: str = ""
    resources: dict = field(default_factory=dict)
    node_selector: dict = field(default_factory=dict)
    tolerations: tuple[dict, ...] = ()
    service_type: str = "ClusterIP"
    service_port: int = 80
    api_key_secret: tuple[str, str] | None = None  # (secret name, key) -> EPDSERVE_API_KEY
    tenancy: TenancySpec | None = None  # tenant keys and the fair queue (operator/tenancy.py)


@dataclass(frozen=True)
class PoolSpec:
    """A validated InferencePool: everything the builders need, nothing from the API."""

    name: str
    namespace: str
    uid: str
    served_name: str
    model_pvc: tuple[str, str] | None  # (claim, path inside)
    model_path: str | None
    model_hf: HubSource | None
    image: str
    pull_policy: str
    pull_secrets: tuple[str, ...]
    tuning: dict  # serve flag (upper snake) -> value, e.g. {"MAX_MODEL_LEN": 4096}
    roles: dict  # role -> RoleSpec, only the roles present
    cache: CacheSpec
    hash_seed: str
    kv_events: bool
    router: RouterSpec
    service_monitor: dict | None  # {"interval": ..., "labels": {...}} when enabled
    network_policy: bool = True  # fence the KV-event and Redis ports to the pool's pods
    device: str = "auto"  # auto: cuda for roles with GPUs, the engine's own choice otherwise
    gpu_memory_utilization: float = 0.9
    autoscaling: AutoscalingSpec = field(default_factory=AutoscalingSpec)
    kv_events_curve: bool = True  # CurveZMQ on the KV-event sockets (keys in a pool Secret)
    lora: LoraSpec | None = None  # `spec.lora`: None serves no adapters

    @property
    def model_arg(self) -> str:
        """The MODEL argument of `epdserve serve` / `--model` of the router."""
        if self.model_pvc:
            claim, path = self.model_pvc
            return "/models/" + path.strip("/") if path.strip("/") else "/models"
        return self.model_path or (self.model_hf.id if self.model_hf else "")

    @property
    def disaggregated(self) -> bool:
        return "colocated" not in self.roles


def _role(raw: dict, where: str) -> RoleSpec:
    requested = resources(raw.get("resources"))
    gpus = role_gpus(raw, requested, where)
    parallel = parse_parallel(raw, requested, where)
    return RoleSpec(
        replicas=int(raw.get("replicas", 1)),
        resources=with_rank_cpus(with_gpus(requested, gpus), parallel),
        gpus=gpus,
        parallel=parallel,
        args=tuple(raw.get("args") or ()),
        env=tuple(raw.get("env") or ()),
        node_selector=dict(raw.get("nodeSelector") or {}),
        tolerations=tuple(raw.get("tolerations") or ()),
        autoscaling=parse_role_autoscaling(raw.get("autoscaling"), where),
    )


_TUNING = {
    "dtype": "DTYPE",
    "maxModelLen": "MAX_MODEL_LEN",
    "blockSize": "BLOCK_SIZE",
    "kvCacheMemory": "KV_CACHE_MEMORY",
    "maxNumSeqs": "MAX_NUM_SEQS",
}


def _tuning(engine: dict) -> dict:
    """The engine flags' values; kvCacheMemory ("4GiB", "512Mi", bytes) in whole bytes, as
    `--kv-cache-memory` takes it."""
    tuning = {flag: engine[key] for key, flag in _TUNING.items() if key in engine}
    if "KV_CACHE_MEMORY" in tuning:
        raw = tuning["KV_CACHE_MEMORY"]
        text = str(raw).strip()
        try:
            tuning["KV_CACHE_MEMORY"] = parse_bytes(text[:-1] if text.endswith("B") else text)
        except ValueError:
            raise InvalidSpec(
                f"spec.engine.kvCacheMemory: {raw!r} is not a size (e.g. 4GiB, 512Mi)"
            ) from None
    return tuning


def parse_pool(body: dict[str, Any]) -> PoolSpec:
    """Turn an InferencePool object (as the API returns it) into a validated PoolSpec."""
    meta = body.get("metadata") or {}
    spec = body.get("spec") or {}
    model = spec.get("model") or {}
    source = model.get("source") or {}
    engine = spec.get("engine") or {}
    roles = {
        r: _role(v or {}, f"spec.roles.{r}")
        for r, v in (spec.get("roles") or {}).items()
        if r in ROLES
    }
    cache = parse_cache(spec.get("cache") or {})
    router = spec.get("router") or {}
    service = router.get("service") or {}
    monitor = (spec.get("metrics") or {}).get("serviceMonitor") or {}
    if not model.get("name"):
        raise InvalidSpec("spec.model.name is required")
    if not engine.get("image"):
        raise InvalidSpec("spec.engine.image is required")
    pvc = source.get("pvc")
    hub = parse_hub_source(source.get("huggingFace"))
    pool = PoolSpec(
        name=meta.get("name", ""),
        namespace=meta.get("namespace", "default"),
        uid=meta.get("uid", ""),
        served_name=model["name"],
        model_pvc=(pvc["claimName"], pvc.get("path", "")) if pvc else None,
        model_path=source.get("path"),
        model_hf=hub,
        image=engine["image"],
        pull_policy=engine.get("imagePullPolicy", "IfNotPresent"),
        pull_secrets=tuple(engine.get("imagePullSecrets") or ()),
        tuning=_tuning(engine),
        roles=roles,
        cache=cache,
        hash_seed=str(spec.get("hashSeed") or meta.get("uid") or meta.get("name", "")),
        kv_events=bool((spec.get("kvEvents") or {}).get("enabled", True)),
        kv_events_curve=bool((spec.get("kvEvents") or {}).get("curve", True)),
        router=RouterSpec(
            replicas=int(router.get("replicas", 1)),
            strategy=router.get("strategy", "prefix+load"),
            image=router.get("image") or engine["image"],
            resources=resources(router.get("resources")),
            node_selector=dict(router.get("nodeSelector") or {}),
            tolerations=tuple(router.get("tolerations") or ()),
            service_type=service.get("type", "ClusterIP"),
            service_port=int(service.get("port", 80)),
            api_key_secret=secret_ref(
                router.get("apiKeySecretRef"), "api-key", "spec.router.apiKeySecretRef"
            ),
            tenancy=parse_tenancy(router.get("tenancy")),
        ),
        service_monitor=(
            {
                "interval": monitor.get("interval", "30s"),
                "labels": dict(monitor.get("labels") or {}),
            }
            if monitor.get("enabled")
            else None
        ),
        network_policy=bool((spec.get("networkPolicy") or {}).get("enabled", True)),
        device=engine.get("device", "auto"),
        gpu_memory_utilization=float(engine.get("gpuMemoryUtilization", 0.9)),
        autoscaling=parse_autoscaling(spec.get("autoscaling")),
        lora=parse_lora(spec.get("lora"), model["name"], hub),
    )
    validate(pool)
    return pool


def validate(pool: PoolSpec) -> None:
    """Raise InvalidSpec for combinations the CRD schema cannot express."""
    sources = [s for s in (pool.model_pvc, pool.model_path, pool.model_hf) if s]
    if len(sources) != 1:
        raise InvalidSpec(
            f"spec.model.source: set exactly one of pvc, path, huggingFace (found {len(sources)})"
        )
    roles = set(pool.roles)
    if not roles:
        raise InvalidSpec("spec.roles: declare colocated, or prefill and decode (and encoder)")
    if "colocated" in roles and roles != {"colocated"}:
        raise InvalidSpec(
            "spec.roles: colocated cannot be combined with "
            + ", ".join(sorted(roles - {"colocated"}))
        )
    if "colocated" not in roles and not {"prefill", "decode"} <= roles:
        missing = sorted({"prefill", "decode"} - roles)
        raise InvalidSpec(f"spec.roles: a disaggregated pool needs {' and '.join(missing)} too")
    validate_cache(pool.cache, pool.disaggregated)
    validate_device(pool)
    validate_parallel(pool)
    if pool.router.strategy not in STRATEGIES:
        raise InvalidSpec(f"spec.router.strategy: unknown strategy {pool.router.strategy!r}")
