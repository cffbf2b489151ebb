"""What crosses between the engine core and its worker processes (DESIGN.md §10): a call
broadcast to every rank, each rank's reply, and the start message a rank reads on stdin.
All msgspec; each method's arguments and result are decoded as their declared types."""

from __future__ import annotations

import traceback

import msgspec

from epdserve.engine.core.interfaces import (
    KVCacheConfig,
    MissingPixelsError,
    ModelRunnerOutput,
    SchedulerOutput,
    WorkerStats,
)
from epdserve.engine.core.kv_cache_groups import KVCacheSpec
from epdserve.engine.executor.shm_ring import RingHandle
from epdserve.engine.lora.slots import LoRASlotLoad

# method -> (its arguments' type, its result's type)
SIGNATURES: dict[str, tuple[type, type]] = {
    "load_model": (tuple[()], None),
    "determine_available_memory": (tuple[KVCacheSpec], int),
    "initialize_kv_cache": (tuple[KVCacheConfig], None),
    "add_lora": (tuple[LoRASlotLoad], None),
    "remove_lora": (tuple[int], None),
    "execute_model": (tuple[SchedulerOutput], ModelRunnerOutput | None),
    "shutdown": (tuple[()], None),
}


class RankCall(msgspec.Struct, array_like=True):
    method: str
    args: msgspec.Raw  # encoded ``SIGNATURES[method][0]``


class RankError(msgspec.Struct, array_like=True, omit_defaults=True):
    """An exception a rank raised, as the core rebuilds it."""

    kind: str  # its class name
    message: str
    identifiers: list[str] = []  # MissingPixelsError's images
    request_ids: list[str] = []  # ... and their requests
    worker_stats: WorkerStats | None = None
    trace: str = ""


class RankReply(msgspec.Struct, array_like=True, omit_defaults=True):
    rank: int
    result: msgspec.Raw = msgspec.Raw(b"\xc0")  # encoded ``SIGNATURES[method][1]`` (nil)
    error: RankError | None = None
    # collectives this rank has entered since it started: equal on every rank of a group
    # that is in step, so a step every rank left at the same point can be contained
    collectives: int = 0


class RankStart(msgspec.Struct, array_like=True):
    """A worker process's start message (stdin): its rank and where everything is."""

    config: bytes  # engine.config.encode_config
    rank: int
    init_method: str  # the group's rendezvous, tcp://127.0.0.1:PORT
    calls: RingHandle  # the broadcast ring it reads (as reader ``rank``)
    cpus: list[int]  # cores it is pinned to ([]: not pinned)
    core_pid: int  # it exits when this process is gone


class RankFailure(RuntimeError):
    """A rank raised while every rank stayed in step: the core contains it like any fault
    of a step (the step guard reruns its requests)."""


class WorkerFailure(RuntimeError):
    """A rank died, hung past its deadline, or left the group out of step: the engine cannot
    go on. The core fails its requests and exits, and the pod restarts."""


def error_of(exc: BaseException) -> RankError:
    return RankError(
        type(exc).__name__,
        str(exc),
        list(getattr(exc, "identifiers", []) or []),
        list(getattr(exc, "request_ids", []) or []),
        getattr(exc, "worker_stats", None),
        "".join(traceback.format_exception(exc))[-4000:],
    )


def rebuild(rank: int, err: RankError) -> Exception:
    """The exception the core raises for ``err``, with the worker's counters on it."""
    if err.kind == "MissingPixelsError":
        exc: Exception = MissingPixelsError(err.identifiers, err.request_ids)
    else:
        exc = RankFailure(f"rank {rank}: {err.kind}: {err.message}")
    exc.worker_stats = err.worker_stats
    return exc
