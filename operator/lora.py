"""LoRA adapters of a pool (pure): `spec.lora` as a validated value, and what it adds to the
engine and router pods — serve flags, the adapter list, volumes and download init containers.

Each adapter has one path on the engine pods: `/lora/<name>` for a Hub adapter (an init
container downloads it into the `hf-cache` volume and links it there, as the model is), the
PVC's mount plus its `path` for a PVC adapter, the given path for a `path` adapter. Encoder
pods run no language model and get none of this.

With `dynamic: false` the adapter list is in the engine command: any change rolls the pods.
With `dynamic: true` the list reaches the pods as `EPDSERVE_LORA_MODULES` from the pool's
ConfigMap (outside the config hash), so a pod that (re)starts reads the current list and a
change alone rolls nothing; the operator loads and unloads the difference on running pods
(``lora_sync``). Changes that need new files in the pod — a new Hub adapter (init container)
or a PVC not mounted yet (volume) — change the pod template and roll the pods either way.
The router pods always carry the list in their command, so a change rolls them (not the
engines): a router then never loads an adapter the spec dropped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from epdserve.operator.errors import InvalidSpec
from epdserve.operator.source import HubSource, download_init_container

LORA_DIR = "/lora"  # Hub adapters are linked here, one directory per adapter name
PVC_DIR = "/lora-pvc"  # PVC adapters: each claim mounted read-only at PVC_DIR/<claim>
CONFIG_KEY = "lora-modules"  # ConfigMap key of the adapter list (dynamic pools)
SERVING_ROLES = ("colocated", "prefill", "decode")  # roles whose pods serve adapters
NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$")
HUB_REPO = re.compile(r"^[\w.-]+(/[\w.-]+)?$")
MAX_RANK = 512
MAX_ADAPTERS = 256


@dataclass(frozen=True)
class Adapter:
    """One entry of `spec.lora.adapters`: exactly one of hub, pvc, path is set."""

    name: str
    hub: HubSource | None = None
    pvc: tuple[str, str] | None = None  # (claim, path inside)
    path: str | None = None

    @property
    def kind(self) -> str:
        return "huggingFace" if self.hub else "pvc" if self.pvc else "path"


@dataclass(frozen=True)
class LoraSpec:
    """`spec.lora`: the adapters every serving pod registers, and the engines' LoRA limits."""

    adapters: tuple[Adapter, ...] = ()
    max_loras: int = 1
    max_rank: int = 16
    dynamic: bool = False


def _where(i: int) -> str:
    return f"spec.lora.adapters[{i}]"


def _plain(value, where: str) -> str:
    """A path the adapter list can carry: no whitespace (the list is whitespace-separated)."""
    if not isinstance(value, str) or not value or any(c.isspace() for c in value):
        raise InvalidSpec(f"{where}: a non-empty path without whitespace, got {value!r}")
    return value


def _hub(raw, where: str, token: tuple[str, str] | None, model_hub: HubSource | None):
    if not isinstance(raw, dict) or not raw.get("repo"):
        raise InvalidSpec(f"{where}.repo is required")
    if not HUB_REPO.match(str(raw["repo"])):
        raise InvalidSpec(f"{where}.repo: a Hub repo id (org/name), got {raw['repo']!r}")
    ref = raw.get("tokenSecretRef")
    if ref and not ref.get("name"):
        raise InvalidSpec(f"{where}.tokenSecretRef.name is required")
    return HubSource(
        id=raw["repo"],
        revision=raw.get("revision") or None,
        token_secret=(ref["name"], ref.get("key") or "token") if ref else token,
        cache_claim=model_hub.cache_claim if model_hub else None,
        cache_host_path=model_hub.cache_host_path if model_hub else None,
    )


def _pvc(raw, where: str) -> tuple[str, str]:
    if not isinstance(raw, dict) or not raw.get("claimName"):
        raise InvalidSpec(f"{where}.claimName is required")
    path = str(raw.get("path") or "").strip("/")
    if path and (".." in path.split("/") or any(c.isspace() for c in path)):
        raise InvalidSpec(f"{where}.path: a path inside the volume without '..' or whitespace")
    return str(raw["claimName"]), path


def _adapter(raw, i: int, model_hub: HubSource | None) -> Adapter:
    where = _where(i)
    if not isinstance(raw, dict):
        raise InvalidSpec(f"{where}: an object {{name, source}}")
    name = raw.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise InvalidSpec(
            f"{where}.name: 1-63 letters, digits, '.', '_' or '-', starting and ending with a "
            f"letter or digit, got {name!r}"
        )
    source = raw.get("source") or {}
    kinds = [k for k in ("huggingFace", "pvc", "path") if source.get(k)]
    if len(kinds) != 1:
        raise InvalidSpec(
            f"{where}.source: set exactly one of huggingFace, pvc, path (found {len(kinds)})"
        )
    token = model_hub.token_secret if model_hub else None
    if kinds == ["huggingFace"]:
        return Adapter(
            name, hub=_hub(source["huggingFace"], f"{where}.source.huggingFace", token, model_hub)
        )
    if kinds == ["pvc"]:
        return Adapter(name, pvc=_pvc(source["pvc"], f"{where}.source.pvc"))
    path = _plain(source["path"], f"{where}.source.path")
    if not path.startswith("/"):
        raise InvalidSpec(f"{where}.source.path: an absolute path, got {path!r}")
    return Adapter(name, path=path)


def _bounded(raw: dict, key: str, default: int, low: int, high: int) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidSpec(f"spec.lora.{key}: an integer in {low}..{high}, got {value!r}")
    return value


def parse_lora(raw, served_name: str, model_hub: HubSource | None) -> LoraSpec | None:
    """`spec.lora`, validated; None when the pool serves no adapters (the section is absent)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise InvalidSpec("spec.lora: an object {adapters, maxLoras, maxRank, dynamic}")
    items = raw.get("adapters") or []
    if not isinstance(items, list) or len(items) > MAX_ADAPTERS:
        raise InvalidSpec(f"spec.lora.adapters: a list of at most {MAX_ADAPTERS} adapters")
    adapters = tuple(_adapter(item, i, model_hub) for i, item in enumerate(items))
    seen: dict[str, int] = {}
    for i, adapter in enumerate(adapters):
        if adapter.name in seen:
            raise InvalidSpec(
                f"{_where(i)}.name: {adapter.name!r} is also adapters[{seen[adapter.name]}]"
            )
        if adapter.name == served_name:
            raise InvalidSpec(f"{_where(i)}.name: {adapter.name!r} is the served model's name")
        seen[adapter.name] = i
    dynamic = raw.get("dynamic", False)
    if not isinstance(dynamic, bool):
        raise InvalidSpec(f"spec.lora.dynamic: true or false, got {dynamic!r}")
    return LoraSpec(
        adapters=adapters,
        max_loras=_bounded(raw, "maxLoras", 1, 1, MAX_ADAPTERS),
        max_rank=_bounded(raw, "maxRank", 16, 1, MAX_RANK),
        dynamic=dynamic,
    )


def pvc_claims(lora: LoraSpec | None, model_claim: str | None) -> list[str]:
    """PVCs the adapters need besides the model's (which is mounted at /models already)."""
    claims = {a.pvc[0] for a in (lora.adapters if lora else ()) if a.pvc}
    return sorted(claims - {model_claim})


def adapter_path(adapter: Adapter, model_claim: str | None) -> str:
    """Where the engine pods find the adapter's directory."""
    if adapter.hub:
        return f"{LORA_DIR}/{adapter.name}"
    if adapter.pvc:
        claim, inside = adapter.pvc
        base = "/models" if claim == model_claim else f"{PVC_DIR}/{claim}"
        return f"{base}/{inside}" if inside else base
    return adapter.path or ""


def modules(lora: LoraSpec, model_claim: str | None) -> list[str]:
    """`name=path` of every adapter, in spec order (`--lora-modules` items)."""
    return [f"{a.name}={adapter_path(a, model_claim)}" for a in lora.adapters]


def serves(lora: LoraSpec | None, role: str) -> bool:
    return lora is not None and role in SERVING_ROLES


def engine_args(lora: LoraSpec | None, role: str, model_claim: str | None) -> list[str]:
    """Serve flags of a role's engine: limits, the runtime switch, the list (static pools)."""
    if not serves(lora, role):
        return []
    args = ["--enable-lora", "--max-loras", str(lora.max_loras)]
    args += ["--max-lora-rank", str(lora.max_rank)]
    if lora.dynamic:
        return [*args, "--allow-runtime-lora-updating"]
    for item in modules(lora, model_claim):
        args += ["--lora-modules", item]
    return args


def list_env(lora: LoraSpec | None, config_map: str, role: str) -> list[dict]:
    """EPDSERVE_LORA_MODULES from the ConfigMap: how a dynamic pool's engine pods get the list."""
    if not serves(lora, role) or not lora.dynamic:
        return []
    ref = {"configMapKeyRef": {"name": config_map, "key": CONFIG_KEY}}
    return [{"name": "EPDSERVE_LORA_MODULES", "valueFrom": ref}]


def config_data(lora: LoraSpec | None, model_claim: str | None) -> dict[str, str]:
    """The ConfigMap entry of a dynamic pool (space-separated `name=path` items)."""
    if lora is None or not lora.dynamic:
        return {}
    return {CONFIG_KEY: " ".join(modules(lora, model_claim))}


def engine_volumes(lora: LoraSpec | None, role: str, model_claim: str | None):
    """(volumes, mounts) of the engine container: /lora for Hub links, one per extra PVC."""
    if not serves(lora, role):
        return [], []
    volumes, mounts = [], []
    if any(a.hub for a in lora.adapters):
        volumes.append({"name": "lora", "emptyDir": {}})
        mounts.append({"name": "lora", "mountPath": LORA_DIR, "readOnly": True})
    for i, claim in enumerate(pvc_claims(lora, model_claim)):
        name = f"lora-pvc-{i}"
        volumes.append(
            {"name": name, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
        )
        mounts.append({"name": name, "mountPath": f"{PVC_DIR}/{claim}", "readOnly": True})
    return volumes, mounts


def init_containers(lora: LoraSpec | None, role: str, image: str, pull_policy: str) -> list:
    """One `download-lora-<i>` init container per Hub adapter (i: its index in the spec):
    `epdserve download REPO [--revision REV] --link /lora/<name>`."""
    if not serves(lora, role):
        return []
    out = []
    for i, adapter in enumerate(lora.adapters):
        if adapter.hub is None:
            continue
        link = f"{LORA_DIR}/{adapter.name}"
        init = download_init_container(image, pull_policy, adapter.hub, link)
        init["name"] = f"download-lora-{i}"
        init["volumeMounts"] = [*init["volumeMounts"], {"name": "lora", "mountPath": LORA_DIR}]
        out.append(init)
    return out


def router_args(lora: LoraSpec | None, model_claim: str | None) -> list[str]:
    """Router flags: the list (name -> path on the pods) and, for a dynamic pool, the switch
    that lets the router load a listed adapter where no pod holds it. The list is in the
    router's command even for a dynamic pool, so a change rolls the router pods (they read it
    at start) and a router never loads an adapter the spec dropped; engine pods do not roll."""
    if lora is None:
        return []
    args = ["--dynamic-lora"] if lora.dynamic else []
    for item in modules(lora, model_claim):
        args += ["--lora-modules", item]
    return args
