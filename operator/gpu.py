"""GPU pools (pure): how many GPUs a role's pods ask for, which device the engine runs on, and
the environment that tells it so (`EPDSERVE_DEVICE`, `EPDSERVE_GPU_MEMORY_UTILIZATION`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from epdserve.operator.errors import InvalidSpec

if TYPE_CHECKING:
    from epdserve.operator.spec import PoolSpec

GPU_RESOURCE = "nvidia.com/gpu"
DEVICES = ("auto", "cpu", "cuda")


def role_gpus(raw: dict, resources: dict, where: str) -> int:
    """GPUs per pod: the role's `gpus`, else the nvidia.com/gpu of its resources (which
    must agree with `gpus` when both are set)."""
    counts = {str(v[GPU_RESOURCE]) for v in resources.values() if GPU_RESOURCE in v}
    if raw.get("gpus"):
        counts.add(str(raw["gpus"]))
    if len(counts) > 1 or not all(c.isdigit() for c in counts):
        raise InvalidSpec(
            f"{where}: gpus and resources {GPU_RESOURCE} must name one whole count, "
            f"got {', '.join(sorted(counts))}"
        )
    return int(counts.pop()) if counts else 0


def with_gpus(resources: dict, gpus: int) -> dict:
    """The container resources with nvidia.com/gpu in requests and limits (an extended
    resource: Kubernetes wants both equal when both are set)."""
    if not gpus:
        return resources
    return {
        **resources,
        **{
            kind: {**resources.get(kind, {}), GPU_RESOURCE: str(gpus)}
            for kind in ("requests", "limits")
        },
    }


def validate_device(pool: PoolSpec) -> None:
    if pool.device not in DEVICES:
        raise InvalidSpec(f"spec.engine.device: one of {', '.join(DEVICES)}, got {pool.device!r}")
    if not 0 < pool.gpu_memory_utilization <= 1:
        raise InvalidSpec(
            "spec.engine.gpuMemoryUtilization: a share of the GPU's memory in (0, 1], "
            f"got {pool.gpu_memory_utilization}"
        )
    gpu_roles = sorted(r for r, spec in pool.roles.items() if spec.gpus)
    if pool.device == "cpu" and gpu_roles:
        raise InvalidSpec(f"spec.engine.device: cpu, but roles {', '.join(gpu_roles)} ask for GPUs")


def role_device(pool: PoolSpec, role: str) -> str | None:
    """The `--device` of a role's engines: cuda when the role has GPUs (device auto) or the
    pool says cuda; None leaves the engine's own `auto`."""
    if pool.device == "auto":
        return "cuda" if pool.roles[role].gpus else None
    return pool.device


def device_env(pool: PoolSpec, role: str) -> list[dict]:
    device = role_device(pool, role)
    if device is None:
        return []
    env = [{"name": "EPDSERVE_DEVICE", "value": device}]
    if device == "cuda":
        share = f"{pool.gpu_memory_utilization:g}"
        env.append({"name": "EPDSERVE_GPU_MEMORY_UTILIZATION", "value": share})
    return env
