"""Tensor parallelism in an engine pod (pure): a role's `tensorParallelSize` ranks share one
pod, and the GPUs, CPUs and /dev/shm they need follow from it (DESIGN.md §10, "Operator").

- A role with GPUs runs one rank per GPU, so its `gpus` (per pod, as ever) must equal its ranks.
- `resources` stay the pod's total, as in any Pod spec; `cpusPerRank` is the other way to say
  it: the pod's cpu requests and limits become cpusPerRank x ranks. `EPDSERVE_CPUS` is the
  pod's total either way; the engine pins each CPU rank to its own share of those cores, so a
  CPU role needs a core per rank.
- /dev/shm (a memory emptyDir every engine pod has) gets a size limit when ranks share the pod:
  the step's ring buffer and the collectives' staging live there.
- The encoder role keeps one rank: its pods run the vision encoder only, which is small
  enough for one device; encoders scale with replicas.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from epdserve.operator.errors import InvalidSpec
from epdserve.operator.gpu import role_device
from epdserve.operator.spec_fields import byte_size

if TYPE_CHECKING:
    from epdserve.operator.spec import PoolSpec

MAX_RANKS = 64
TP_ENV = "EPDSERVE_TENSOR_PARALLEL_SIZE"  # `epdserve serve --tensor-parallel-size`
CPUS_ENV = "EPDSERVE_CPUS"  # read by epdserve.engine.cpus (the operator imports no engine)
TP_FLAGS = ("--tensor-parallel-size", "-tp")
# /dev/shm per rank when no shmSize is given: the size limit is a cap, not a reservation (tmpfs
# pages count against the pod's memory only once written). GPUs get more for NCCL's
# shared-memory transport, where the GPUs cannot reach each other directly.
SHM_MIB_PER_RANK = {"cuda": 512, "cpu": 256}


@dataclass(frozen=True)
class RoleParallel:
    """How a role's pod splits into ranks (`spec.roles.<role>`)."""

    tensor_parallel_size: int = 1
    cpus_per_rank: int | None = None  # whole cores per rank: sets the pod's cpu
    shm_size: str | None = None  # /dev/shm size limit as given (a quantity)


def _whole(value, where: str, most: int | None) -> int:
    """A whole number from 1 to `most` (the schema's bounds, for bodies that skipped it)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidSpec(f"{where}: a whole number of at least 1, got {value!r}")
    if most is not None and value > most:
        raise InvalidSpec(f"{where}: at most {most}, got {value}")
    return value


def _refuse_engine_setting(raw: dict, where: str) -> None:
    """The ranks are the field's alone: a flag or variable would leave the GPUs behind."""
    hint = f"set {where}.tensorParallelSize instead (the pod's GPUs and /dev/shm follow it)"
    for arg in map(str, raw.get("args") or ()):
        if arg in TP_FLAGS or arg.startswith(tuple(f + "=" for f in TP_FLAGS)):
            raise InvalidSpec(f"{where}.args: {arg.partition('=')[0]}: {hint}")
    if any((e or {}).get("name") == TP_ENV for e in raw.get("env") or ()):
        raise InvalidSpec(f"{where}.env: {TP_ENV}: {hint}")


def parse_parallel(raw: dict, requested: dict, where: str) -> RoleParallel:
    """The role's ranks, cores per rank and /dev/shm size (`requested`: its resources)."""
    ranks = _whole(raw.get("tensorParallelSize", 1), f"{where}.tensorParallelSize", MAX_RANKS)
    per_rank = raw.get("cpusPerRank")
    if per_rank is not None:
        per_rank = _whole(per_rank, f"{where}.cpusPerRank", None)
        if any("cpu" in amounts for amounts in requested.values()):
            raise InvalidSpec(
                f"{where}.cpusPerRank: sets the pod's cpu requests and limits; "
                f"leave cpu out of {where}.resources"
            )
    shm = raw.get("shmSize")
    byte_size(shm, f"{where}.shmSize")
    _refuse_engine_setting(raw, where)
    return RoleParallel(ranks, per_rank, None if shm is None else str(shm))


def with_rank_cpus(resources: dict, parallel: RoleParallel) -> dict:
    """The container resources with cpu = cpusPerRank x ranks in requests and limits."""
    if parallel.cpus_per_rank is None:
        return resources
    cpus = str(parallel.cpus_per_rank * parallel.tensor_parallel_size)
    return {
        **resources,
        **{kind: {**resources.get(kind, {}), "cpu": cpus} for kind in ("requests", "limits")},
    }


def validate_parallel(pool: PoolSpec) -> None:
    """Raise InvalidSpec where a role's ranks cannot get a device or a core each."""
    for role, spec in pool.roles.items():
        ranks, where = spec.parallel.tensor_parallel_size, f"spec.roles.{role}"
        if ranks == 1:
            continue
        if role == "encoder":
            raise InvalidSpec(
                f"{where}.tensorParallelSize: an encoder pod runs the vision encoder on one "
                f"device; scale encoders with replicas (got {ranks})"
            )
        if spec.gpus and spec.gpus != ranks:
            raise InvalidSpec(
                f"{where}.gpus: tensorParallelSize {ranks} runs one rank per GPU, so each pod "
                f"needs gpus: {ranks} (got {spec.gpus})"
            )
        cpus = pod_cpus(spec.resources)
        if role_device(pool, role) != "cuda" and cpus is not None and cpus < ranks:
            raise InvalidSpec(
                f"{where}.resources: {ranks} CPU ranks are pinned to a core each, so the pod "
                f"needs {ranks} CPUs or more (got {cpus}); or set {where}.cpusPerRank"
            )


def pod_cpus(resources: dict) -> int | None:
    """The CPUs an engine pod has: its CPU limit, else its request, rounded down (at least
    1), for ``EPDSERVE_CPUS``; the engine then gives its core all of them or all but one,
    by the model's size (engine/cpus.py). None when neither is set (the engine then counts
    its affinity within its cgroup's limit)."""
    amount = (resources.get("limits") or {}).get("cpu") or (resources.get("requests") or {}).get(
        "cpu"
    )
    if amount is None:
        return None
    text = str(amount)
    try:
        cpus = float(text[:-1]) / 1000 if text.endswith("m") else float(text)
    except ValueError:
        return None
    return max(1, math.floor(cpus))


def engine_env(pool: PoolSpec, role: str, user: list[dict]) -> list[dict]:
    """`EPDSERVE_TENSOR_PARALLEL_SIZE` (more than one rank) and `EPDSERVE_CPUS` (the pod's
    total; not when the role's own `env` sets it)."""
    spec = pool.roles[role]
    env = []
    if spec.parallel.tensor_parallel_size > 1:
        env.append({"name": TP_ENV, "value": str(spec.parallel.tensor_parallel_size)})
    cpus = pod_cpus(spec.resources)
    if cpus and not any(e.get("name") == CPUS_ENV for e in user):
        env.append({"name": CPUS_ENV, "value": str(cpus)})
    return env


def shm_size(pool: PoolSpec, role: str) -> str | None:
    """The /dev/shm size limit: `shmSize`, else per rank by device when ranks share the pod,
    else None (one rank: no limit, as before tensor parallelism)."""
    parallel = pool.roles[role].parallel
    if parallel.shm_size is not None:
        return parallel.shm_size
    if parallel.tensor_parallel_size == 1:
        return None
    mib = SHM_MIB_PER_RANK[role_device(pool, role) or "cpu"] * parallel.tensor_parallel_size
    return f"{mib // 1024}Gi" if mib % 1024 == 0 else f"{mib}Mi"


def shm_volume(pool: PoolSpec, role: str) -> tuple[dict, dict]:
    """(volume, mount) of /dev/shm: memory, since the root filesystem is read-only and the
    engine's processes share memory through it."""
    empty_dir = {"medium": "Memory"}
    if (size := shm_size(pool, role)) is not None:
        empty_dir["sizeLimit"] = size
    return {"name": "dshm", "emptyDir": empty_dir}, {"name": "dshm", "mountPath": "/dev/shm"}
