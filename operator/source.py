"""Models from the HuggingFace Hub (pure): the `huggingFace` source of the spec, the cache
volume every pod mounts at HF_HOME, and the init container that downloads the model into it.

The init container runs `epdserve download ID --revision REV` with the token; the main
container then starts with `HF_HUB_OFFLINE=1` and finds the snapshot in the same cache, so a
pod never starts half-downloaded and the engine never talks to the Hub. The cache is a shared
ReadWriteMany PVC (downloaded once per cluster), a node directory (once per node) or, by
default, an emptyDir (once per pod start).
"""

from __future__ import annotations

from dataclasses import dataclass

from epdserve.operator.errors import InvalidSpec

HF_HOME = "/var/cache/huggingface"
ROUTER_MODEL_LINK = "/tmp/model"  # the router reads the snapshot through this symlink


@dataclass(frozen=True)
class HubSource:
    """`spec.model.source.huggingFace`."""

    id: str
    revision: str | None = None
    token_secret: tuple[str, str] | None = None  # (secret name, key) -> HF_TOKEN
    cache_claim: str | None = None  # a ReadWriteMany PVC shared by every pod
    cache_host_path: str | None = None  # a directory on each node


def parse_hub_source(raw: dict | None) -> HubSource | None:
    """The huggingFace source of the spec, or None when the model comes from elsewhere."""
    if not raw:
        return None
    where = "spec.model.source.huggingFace"
    if not isinstance(raw, dict):  # v1alpha1 once took the bare id
        raise InvalidSpec(f"{where}: an object {{id, revision, tokenSecretRef, cache}}")
    if not raw.get("id"):
        raise InvalidSpec(f"{where}.id is required")
    token = raw.get("tokenSecretRef")
    if token and not token.get("name"):
        raise InvalidSpec(f"{where}.tokenSecretRef.name is required")
    cache = raw.get("cache") or {}
    if cache.get("claimName") and cache.get("hostPath"):
        raise InvalidSpec(f"{where}.cache: set at most one of claimName, hostPath")
    return HubSource(
        id=raw["id"],
        revision=raw.get("revision") or None,
        token_secret=(token["name"], token.get("key") or "token") if token else None,
        cache_claim=cache.get("claimName") or None,
        cache_host_path=cache.get("hostPath") or None,
    )


def cache_volume(hub: HubSource | None) -> dict:
    """The `hf-cache` volume mounted at HF_HOME in every engine and router pod."""
    if hub and hub.cache_claim:
        return {"name": "hf-cache", "persistentVolumeClaim": {"claimName": hub.cache_claim}}
    if hub and hub.cache_host_path:
        host = {"path": hub.cache_host_path, "type": "DirectoryOrCreate"}
        return {"name": "hf-cache", "hostPath": host}
    return {"name": "hf-cache", "emptyDir": {}}


def cache_mount() -> dict:
    return {"name": "hf-cache", "mountPath": HF_HOME}


def offline_env(hub: HubSource | None) -> list[dict]:
    """The main container reads the cache the init container filled, never the network."""
    if hub is None:
        return []
    env = [{"name": "HF_HUB_OFFLINE", "value": "1"}]
    if hub.revision:
        env.append({"name": "EPDSERVE_REVISION", "value": hub.revision})
    return env


def download_init_container(image: str, pull_policy: str, hub: HubSource, link: str = "") -> dict:
    """`epdserve download ID [--revision REV] [--link PATH]` with HF_HOME on the cache volume
    and HF_TOKEN from the Secret (only this container sees the token)."""
    command = ["epdserve", "download", hub.id]
    if hub.revision:
        command += ["--revision", hub.revision]
    if link:
        command += ["--link", link]
    env = [
        {"name": "HOME", "value": "/tmp"},
        {"name": "HF_HOME", "value": HF_HOME},
        {"name": "HF_HUB_DISABLE_PROGRESS_BARS", "value": "1"},  # no bars in pod logs
    ]
    if hub.token_secret:
        name, key = hub.token_secret
        secret = {"secretKeyRef": {"name": name, "key": key}}
        env.append({"name": "HF_TOKEN", "valueFrom": secret})
    return {
        "name": "download-model",
        "image": image,
        "imagePullPolicy": pull_policy,
        "command": command,
        "env": env,
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, cache_mount()],
        "securityContext": _container_security_context(),
    }


def _container_security_context() -> dict:
    # imported here: meta imports spec, which imports this module
    from epdserve.operator import meta

    return meta.container_security_context()
