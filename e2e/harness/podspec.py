"""What a kubelet derives from a Pod object before it starts a container (pure functions).

Environment (downward API, Secret / ConfigMap references, service links, `$(VAR)`
expansion), the command line, volumes as host directories, and the security settings that
podinit applies. API objects come through a `lookup(kind, namespace, name) -> dict | None`.
"""

from __future__ import annotations

import base64
import math
import re
from pathlib import Path

_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


class ConfigError(Exception):
    """A container cannot be configured yet (CreateContainerConfigError): names the object."""


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion: defined variables replaced, `$$` -> `$`, rest kept."""

    def repl(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _VAR.sub(repl, text)


def field_ref(pod: dict, path: str) -> str:
    """The downward API's fieldRef values."""
    meta, spec, status = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
    simple = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"),
        "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName", "default"),
        "status.podIP": status.get("podIP"),
        "status.hostIP": status.get("hostIP"),
    }
    if path in simple:
        return simple[path] or ""
    m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if m:
        return (meta.get(m.group(1)) or {}).get(m.group(2), "")
    raise ConfigError(f"fieldRef {path!r} is not supported by the e2e kubelet")


def _key_ref(lookup, namespace: str, kind: str, ref: dict) -> str | None:
    obj = lookup(kind, namespace, ref["name"])
    if obj is None:
        if ref.get("optional"):
            return None
        raise ConfigError(f'{kind.lower()} "{ref["name"]}" not found')
    if kind == "Secret":
        data = {k: base64.b64decode(v).decode() for k, v in (obj.get("data") or {}).items()}
        data.update(obj.get("stringData") or {})
    else:
        data = dict(obj.get("data") or {})
    if ref["key"] not in data:
        if ref.get("optional"):
            return None
        raise ConfigError(f"couldn't find key {ref['key']} in {kind} {namespace}/{ref['name']}")
    return data[ref["key"]]


def service_env(services: list[dict]) -> dict[str, str]:
    """Docker-link style variables for the namespace's Services (enableServiceLinks)."""
    env = {}
    for svc in services:
        spec = svc.get("spec") or {}
        ip = spec.get("clusterIP")
        ports = spec.get("ports") or []
        if not ip or ip == "None" or not ports:
            continue
        name = svc["metadata"]["name"].upper().replace("-", "_")
        first = ports[0]
        env[f"{name}_SERVICE_HOST"] = ip
        env[f"{name}_SERVICE_PORT"] = str(first["port"])
        env[f"{name}_PORT"] = f"tcp://{ip}:{first['port']}"
        for p in ports:
            proto = p.get("protocol", "TCP")
            base = f"{name}_PORT_{p['port']}_{proto}"
            env[base] = f"{proto.lower()}://{ip}:{p['port']}"
            env[base + "_PROTO"], env[base + "_PORT"], env[base + "_ADDR"] = (
                proto.lower(),
                str(p["port"]),
                ip,
            )
            if p.get("name"):
                env[f"{name}_SERVICE_PORT_{p['name'].upper().replace('-', '_')}"] = str(p["port"])
    return env


def container_env(pod, container, lookup, services, base: dict[str, str]) -> dict[str, str]:
    """The container's environment, in Kubernetes' order: image defaults, service links,
    envFrom, env (each value may expand variables defined before it)."""
    namespace = pod["metadata"]["namespace"]
    env = dict(base)
    if (pod.get("spec") or {}).get("enableServiceLinks", True):
        env.update(service_env(services))
    master = next((s for s in services if s["metadata"]["name"] == "kubernetes"), None)
    if master is not None:  # the kubelet always injects the API server's address
        env["KUBERNETES_SERVICE_HOST"] = master["spec"]["clusterIP"]
        env["KUBERNETES_SERVICE_PORT"] = str(master["spec"]["ports"][0]["port"])
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        for kind, key in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
            if key in source:
                obj = lookup(kind, namespace, source[key]["name"])
                if obj is None and not source[key].get("optional"):
                    raise ConfigError(f'{kind.lower()} "{source[key]["name"]}" not found')
                for k, v in ((obj or {}).get("data") or {}).items():
                    env[prefix + k] = base64.b64decode(v).decode() if kind == "Secret" else v
    for item in container.get("env") or []:
        value = _env_value(pod, item, lookup, namespace, env)
        if value is not None:
            env[item["name"]] = value
    return env


def _env_value(pod, item, lookup, namespace, env) -> str | None:
    if "valueFrom" not in item:
        return expand(str(item.get("value", "")), env)
    source = item["valueFrom"]
    if "fieldRef" in source:
        return field_ref(pod, source["fieldRef"]["fieldPath"])
    if "secretKeyRef" in source:
        return _key_ref(lookup, namespace, "Secret", source["secretKeyRef"])
    if "configMapKeyRef" in source:
        return _key_ref(lookup, namespace, "ConfigMap", source["configMapKeyRef"])
    if "resourceFieldRef" in source:
        return "0"  # resources are not enforced here; report "no limit"
    raise ConfigError(f"env {item['name']}: unsupported valueFrom {sorted(source)}")


def container_argv(container: dict, env: dict[str, str]) -> list[str]:
    """command + args with `$(VAR)` expanded (every pod here sets a command)."""
    command = container.get("command") or []
    if not command:
        raise ConfigError(f"container {container['name']}: no command (image entrypoints unknown)")
    return [expand(a, env) for a in command + (container.get("args") or [])]


def write_files(root: Path, files: dict[str, bytes], mode: int) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        path.chmod(mode)


def _data_files(kind: str, obj: dict, items, optional: bool = False) -> dict[str, bytes]:
    """A Secret's or ConfigMap's keys as files; `items` projects (and renames) some of them,
    and one naming a missing key stops the pod unless the source is optional, as on a node."""
    if kind == "Secret":
        data = {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
    else:
        data = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
    if not items:
        return data
    missing = [i["key"] for i in items if i["key"] not in data]
    if missing and not optional:
        name = (obj.get("metadata") or {}).get("name", "")
        raise ConfigError(f"couldn't find key {missing[0]} in {kind} {name}")
    return {i["path"]: data[i["key"]] for i in items if i["key"] in data}


_QUANTITY = re.compile(r"([0-9]+(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?)([KMGTPE]i|[kMGTPE]|m)?")
_SCALE = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}
_SCALE.update({f"{p}i": 1024 ** (i + 1) for i, p in enumerate("KMGTPE")})


def quantity_bytes(quantity) -> int:
    """A resource quantity (``512Mi``, ``1G``, ``1e9``) in whole bytes, rounded up."""
    m = _QUANTITY.fullmatch(str(quantity))
    if not m:
        raise ConfigError(f"quantity {quantity!r} is not a Kubernetes quantity")
    return math.ceil(float(m.group(1)) * _SCALE.get(m.group(2) or "", 1))


def volume_source(pod, volume, lookup, pod_dir: Path, token) -> dict:
    """Materialise one volume: {"source": host path} (readOnly optional), or for a memory
    emptyDir {"source": None, "size": its sizeLimit in bytes or None} (the kubelet's tmpfs).
    A claim resolves through the API to its bound PersistentVolume's hostPath or local path;
    `token(pod, source)` gives a projected ServiceAccount token."""
    namespace, name = pod["metadata"]["namespace"], volume["name"]
    where = pod_dir / "volumes" / name
    if "emptyDir" in volume:
        if (volume["emptyDir"] or {}).get("medium") == "Memory":  # tmpfs, sized as a node does
            limit = (volume["emptyDir"] or {}).get("sizeLimit")
            return {"source": None, "size": None if limit is None else quantity_bytes(limit)}
        where.mkdir(parents=True, exist_ok=True)
        where.chmod(0o777)  # emptyDir is world-writable, as on a node
        return {"source": str(where)}
    if "persistentVolumeClaim" in volume:
        claim = volume["persistentVolumeClaim"]
        pvc = lookup("PersistentVolumeClaim", namespace, claim["claimName"]) or {}
        bound = (pvc.get("spec") or {}).get("volumeName")
        pv_spec = ((bound and lookup("PersistentVolume", None, bound)) or {}).get("spec") or {}
        path = (pv_spec.get("hostPath") or pv_spec.get("local") or {}).get("path")
        if not path:
            raise ConfigError(f'persistentvolumeclaim "{claim["claimName"]}" not bound')
        return {"source": path, "readOnly": claim.get("readOnly")}
    if "hostPath" in volume:
        return {"source": volume["hostPath"]["path"]}
    files: dict[str, bytes] = {}
    mode = 0o644
    for kind, key in (("ConfigMap", "configMap"), ("Secret", "secret")):
        if key in volume:
            src = volume[key]
            ref = src.get("name") or src.get("secretName")
            obj = lookup(kind, namespace, ref)
            if obj is None and not src.get("optional"):
                raise ConfigError(f'{kind.lower()} "{ref}" not found')
            files = _data_files(kind, obj or {}, src.get("items"), bool(src.get("optional")))
            mode = src.get("defaultMode", mode)
    if "projected" in volume:
        files = _projected(pod, volume["projected"], lookup, token)
        mode = volume["projected"].get("defaultMode", mode)
    if not files and not any(k in volume for k in ("configMap", "secret", "projected")):
        raise ConfigError(f"volume {name}: unsupported source {sorted(volume)}")
    write_files(where, files, mode)
    return {"source": str(where), "readOnly": True}


def _projected(pod, projected: dict, lookup, token) -> dict[str, bytes]:
    namespace = pod["metadata"]["namespace"]
    files: dict[str, bytes] = {}
    for source in projected.get("sources") or []:
        if "serviceAccountToken" in source:
            request = source["serviceAccountToken"]
            files[request.get("path", "token")] = token(pod, request).encode()
        for kind, key in (("ConfigMap", "configMap"), ("Secret", "secret")):
            if key in source:
                obj = lookup(kind, namespace, source[key]["name"]) or {}
                # lenient: the harness makes kube-root-ca.crt in `default` only
                files.update(_data_files(kind, obj, source[key].get("items"), optional=True))
        for item in (source.get("downwardAPI") or {}).get("items") or []:
            files[item["path"]] = field_ref(pod, item["fieldRef"]["fieldPath"]).encode()
    return files


def security(pod: dict, container: dict) -> dict:
    """uid/gid/groups, no_new_privs and read-only root for podinit (container wins)."""
    pod_ctx = (pod.get("spec") or {}).get("securityContext") or {}
    ctx = container.get("securityContext") or {}
    uid = ctx.get("runAsUser", pod_ctx.get("runAsUser"))
    gid = ctx.get("runAsGroup", pod_ctx.get("runAsGroup"))
    if uid is not None and gid is None:
        gid = 0
    groups = [g for g in [pod_ctx.get("fsGroup"), *(pod_ctx.get("supplementalGroups") or [])] if g]
    if (ctx.get("runAsNonRoot") or pod_ctx.get("runAsNonRoot")) and not uid:
        raise ConfigError("container has runAsNonRoot and image will run as root")
    return {
        "uid": uid,
        "gid": gid,
        "groups": groups,
        "noNewPrivs": ctx.get("allowPrivilegeEscalation") is False,
        "readOnlyRoot": bool(ctx.get("readOnlyRootFilesystem")),
    }
