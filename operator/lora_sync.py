"""Adapters on running pods (`spec.lora.dynamic: true`): each reconcile compares every ready
serving pod's `/v1/models` with the spec and calls its `POST /v1/load_lora_adapter` /
`/v1/unload_lora_adapter` for the difference, then reports per role what it found.

Level-triggered, as the rest of the reconcile: a pod that was starting, unreachable or
refused a load is looked at again on the next pass. Only adapters whose files the pod has
are loaded: a `path`, a PVC the pod mounts, a Hub adapter its init containers downloaded
(one added later rolls the pods, whose new ones start with it). Calls have timeouts and
their failures go to the status, never out of the reconcile.
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import urllib.error
import urllib.request

from epdserve.operator import lora, meta
from epdserve.operator.kube import ApiError, Kube
from epdserve.operator.spec import PoolSpec

logger = logging.getLogger("epdserve.operator.lora")
LIST_TIMEOUT_S = 5.0  # GET /v1/models
LOAD_TIMEOUT_S = 60.0  # a load reads the adapter's weights
MAX_ERRORS = 5  # per role in the status; the rest are counted
MAX_MESSAGE = 300


class PodClient:
    """The adapter routes of one pool's engine pods (with the pool's API key, if any)."""

    def __init__(self, api_key: str | None = None):
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def call(self, url: str, body: dict | None, timeout: float) -> bytes:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(url, data=data, headers=self.headers)
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310
                return response.read()
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"{exc.code} {_error_text(exc.read())}") from None
        except (OSError, ValueError, http.client.HTTPException) as exc:  # refused, reset, timeout
            raise RuntimeError(f"{type(exc).__name__}: {exc}") from None

    def adapters(self, base: str) -> dict[str, str]:
        """Adapter name -> path the pod serves (the /v1/models entries with a parent)."""
        page = json.loads(self.call(f"{base}/v1/models", None, LIST_TIMEOUT_S))
        return {m["id"]: m.get("root") or "" for m in page.get("data") or [] if m.get("parent")}

    def load(self, base: str, name: str, path: str) -> None:
        body = {"lora_name": name, "lora_path": path}
        self.call(f"{base}/v1/load_lora_adapter", body, LOAD_TIMEOUT_S)

    def unload(self, base: str, name: str) -> None:
        self.call(f"{base}/v1/unload_lora_adapter", {"lora_name": name}, LOAD_TIMEOUT_S)


def _error_text(raw: bytes) -> str:
    """The message of an OpenAI-shaped error body, else the body's start."""
    try:
        error = json.loads(raw).get("error")
        text = error.get("message") if isinstance(error, dict) else None
    except (ValueError, AttributeError):
        text = None
    return (text or raw[:MAX_MESSAGE].decode(errors="replace")).strip()


def api_key(kube: Kube, pool: PoolSpec) -> str | None:
    """The pool's API key, read from its Secret (RuntimeError naming what to grant)."""
    if pool.router.api_key_secret is None:
        return None
    name, key = pool.router.api_key_secret
    try:
        secret = kube.get("v1", "Secret", pool.namespace, name)
    except ApiError as exc:
        hint = " (list it in the chart's secrets.readNames)" if exc.status == 403 else ""
        raise RuntimeError(f"API-key Secret {name} not readable{hint}: {exc}") from None
    value = ((secret or {}).get("data") or {}).get(key)
    if value is None:
        raise RuntimeError(f"API-key Secret {name} has no key {key!r}")
    return base64.b64decode(value).decode()


def ready(pod: dict) -> bool:
    status = pod.get("status") or {}
    conditions = status.get("conditions") or []
    is_ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    return is_ready and bool(status.get("podIP")) and not pod["metadata"].get("deletionTimestamp")


def pod_url(pod: dict) -> str:
    """http://IP:PORT of the pod's engine container (its `http` port, else the default)."""
    port = meta.HTTP_PORT
    for container in (pod.get("spec") or {}).get("containers") or []:
        for p in container.get("ports") or []:
            if p.get("name") == "http":
                port = int(p["containerPort"])
    return f"http://{pod['status']['podIP']}:{port}"


def has_files(pod: dict, adapter: lora.Adapter, model_claim: str | None) -> bool:
    """Whether the pod can read the adapter's directory (see the module docstring)."""
    spec = pod.get("spec") or {}
    if adapter.pvc:
        claims = {
            (v.get("persistentVolumeClaim") or {}).get("claimName")
            for v in spec.get("volumes") or []
        }
        return adapter.pvc[0] in claims
    if adapter.hub:
        link = lora.adapter_path(adapter, model_claim)
        command = ["epdserve", "download", adapter.hub.id]
        command += ["--revision", adapter.hub.revision] if adapter.hub.revision else []
        command += ["--link", link]
        return any(c.get("command") == command for c in spec.get("initContainers") or [])
    return True


def sync_pod(client: PodClient, pool: PoolSpec, pod: dict) -> tuple[set[str], list[str]]:
    """Load and unload on one pod; (adapters it serves afterwards, errors)."""
    base, claim = pod_url(pod), (pool.model_pvc[0] if pool.model_pvc else None)
    name = pod["metadata"]["name"]
    try:
        have = client.adapters(base)
    except (RuntimeError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return set(), [f"{name}: GET /v1/models: {exc}"]
    want = {a.name: a for a in pool.lora.adapters}
    errors = []
    for adapter_name, path in sorted(have.items()):
        stale = adapter_name in want and path != lora.adapter_path(want[adapter_name], claim)
        if adapter_name not in want or (stale and has_files(pod, want[adapter_name], claim)):
            try:
                client.unload(base, adapter_name)
                del have[adapter_name]
            except RuntimeError as exc:
                errors.append(f"{name}: unload {adapter_name}: {exc}")
    for adapter in pool.lora.adapters:
        if adapter.name in have or not has_files(pod, adapter, claim):
            continue
        try:
            client.load(base, adapter.name, lora.adapter_path(adapter, claim))
            have[adapter.name] = lora.adapter_path(adapter, claim)
        except RuntimeError as exc:
            errors.append(f"{name}: load {adapter.name}: {exc}")
    return set(have), errors


def sync(kube: Kube, pool: PoolSpec, client: PodClient | None = None) -> dict:
    """`status.lora`: per serving role, the spec's adapters (for a dynamic pool each with
    `pods`: "ready pods serving it/ready pods") and this pass's failures. Only lists inside:
    the status is merge-patched, and a list is replaced whole, so nothing stale stays."""
    if pool.lora is None:
        return {}
    roles = [r for r in pool.roles if lora.serves(pool.lora, r)]
    adapters = [{"name": a.name} for a in pool.lora.adapters]
    out = {role: {"adapters": [dict(a) for a in adapters], "errors": []} for role in roles}
    if not pool.lora.dynamic:
        return out
    try:
        client = client or PodClient(api_key(kube, pool))
    except RuntimeError as exc:
        return {role: {**entry, "errors": [str(exc)]} for role, entry in out.items()}
    for role in roles:
        out[role] = sync_role(kube, client, pool, role)
    return out


def sync_role(kube: Kube, client: PodClient, pool: PoolSpec, role: str) -> dict:
    """One role's entry, after loading and unloading on its ready pods."""
    selector = f"{meta.POOL_LABEL}={pool.name},{meta.ROLE_LABEL}={role}"
    counts = {a.name: 0 for a in pool.lora.adapters}
    errors: list[str] = []
    try:
        pods = [p for p in kube.list("v1", "Pod", pool.namespace, selector) if ready(p)]
    except ApiError as exc:
        pods, errors = [], [f"listing {role} pods: {exc}"]
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        served, failed = sync_pod(client, pool, pod)
        for name in served & counts.keys():
            counts[name] += 1
        errors += failed
    for error in errors:
        logger.warning("pool %s/%s: %s", pool.namespace, pool.name, error)
    shown = [e[:MAX_MESSAGE] for e in errors[:MAX_ERRORS]]
    if len(errors) > MAX_ERRORS:
        shown.append(f"... and {len(errors) - MAX_ERRORS} more")
    adapters = [{"name": name, "pods": f"{n}/{len(pods)}"} for name, n in counts.items()]
    return {"adapters": adapters, "errors": shown}


def failing(status: dict) -> bool:
    """Whether a `status.lora` reports any failure."""
    return any(entry.get("errors") for entry in (status or {}).values())
