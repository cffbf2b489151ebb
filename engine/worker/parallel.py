"""A worker's tensor-parallel group (DESIGN.md §10): its rank, the group's size and the
collectives the model and the runner use (CPU ranks: through shared memory,
``shm_collectives``; ``EPDSERVE_SHM_COLLECTIVES=0`` keeps gloo). Size 1 makes every collective a no-op, so one
model code path serves TP 1 and TP N.

``torch.distributed`` carries them: gloo on CPU, NCCL on CUDA. Every collective is bounded
by the group's timeout, so no rank waits forever for a peer that died or hung; each one is
counted (``num_collectives``), and the executor compares the counts after a failed step to
tell a step every rank left at the same point (contained, the step guard reruns it) from one
that left the group out of step (the pod restarts).
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from epdserve.engine.worker.shm_collectives import ShmCollectives

# a slot per rank per buffer: all-reduces go in chunks of it, gathers larger than it via gloo
SHM_SLOT_BYTES = 4 << 20


def step_timeout_s() -> float:
    """How long a step, and a collective in it, may take before its rank counts as hung
    (``EPDSERVE_STEP_TIMEOUT_S``; default 120 s: a long CPU prefill stays well under)."""
    return float(os.environ.get("EPDSERVE_STEP_TIMEOUT_S") or 120.0)


class TPGroup:
    """Rank ``rank`` of ``size``; output rank 0 holds the gathered logits and samples."""

    def __init__(self, rank: int = 0, size: int = 1, shm: ShmCollectives | None = None):
        self.rank, self.size = rank, size
        self.num_collectives = 0
        self.shm = shm  # CPU ranks: collectives through shared memory, not gloo's sockets

    @property
    def is_output(self) -> bool:
        return self.rank == 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place."""
        if self.size > 1:
            self.num_collectives += 1
            if self.shm is not None:
                return self.shm.all_reduce(t)
            dist.all_reduce(t)
        return t

    def gather_last(self, t: torch.Tensor) -> torch.Tensor | None:
        """The ranks' ``t`` side by side along the last dim, on rank 0 (None elsewhere)."""
        if self.size == 1:
            return t
        self.num_collectives += 1
        t = t.contiguous()
        if self.shm is not None and self.shm.fits(t):
            return self.shm.gather_last(t)
        parts = [torch.empty_like(t) for _ in range(self.size)] if self.is_output else None
        dist.gather(t, parts, dst=0)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``t`` on every rank (in place)."""
        if self.size > 1:
            self.num_collectives += 1
            if self.shm is not None:
                return self.shm.broadcast(t)
            dist.broadcast(t, src=0)
        return t

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()


def init_tp_group(
    rank: int, size: int, init_method: str, device: torch.device, timeout_s: float
) -> TPGroup:
    """Join the group of ``size`` ranks rendezvousing at ``init_method`` (``tcp://host:port``).
    A peer missing at the rendezvous or in a collective raises after ``timeout_s``."""
    if size == 1:
        return TPGroup()
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    shm = None
    if device.type == "cpu" and os.environ.get("EPDSERVE_SHM_COLLECTIVES", "1") != "0":
        port = init_method.rsplit(":", 1)[-1]
        name = f"epdserve-tp-{os.getppid()}-{port}"  # the ranks share their parent, the core
        shm = join_shm_collectives(rank, size, name, timeout_s)
    return TPGroup(rank, size, shm)


def join_shm_collectives(
    rank: int, size: int, name: str, timeout_s: float, slot_bytes: int = SHM_SLOT_BYTES
) -> ShmCollectives:
    """Every rank of the (initialized) process group maps segment ``name``: rank 0 creates
    it, the others attach after a barrier, and rank 0 unlinks the name once all have."""
    shm = ShmCollectives(rank, size, name, slot_bytes, timeout_s)
    if rank == 0:
        shm.create()
    dist.barrier()
    if rank:
        shm.attach()
    dist.barrier()
    if rank == 0:
        shm.unlink()  # mapped by every rank: the name is no longer needed
    return shm
