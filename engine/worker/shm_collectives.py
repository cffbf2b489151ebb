"""Collectives of CPU ranks through one shared-memory segment (DESIGN.md §10: "a
shared-memory all-reduce where it pays").

gloo moves a tensor through TCP sockets: on a 2-core host an all-reduce of one decode row
took 0.23 ms and of 8-512 rows 1.4-2.4 ms, which at two per layer made a TP 2 step several
times slower than the whole TP 1 step (``bench/tensor_parallel.py``). Ranks of one pod share
a host, so each writes its tensor into its own slot of a segment, raises its sequence flag,
waits for every rank's flag, and reads the others' slots: one copy in, one pass out.

Layout: a flag per rank (int64, each on its own 64-byte line), then two sets of ``size``
slots of ``slot_bytes``. Call ``k`` uses set ``k % 2``: a rank writes set ``k % 2`` only after
every rank raised flag ``k - 1``, which each does only after it finished reading set
``k % 2`` at call ``k - 2``, so one barrier per call suffices. Tensors larger than a slot go
in slot-sized chunks. Sums run in rank order on every rank (in fp32 for 16-bit types), so
every rank gets the same bits. A wait longer than the step deadline raises ``TimeoutError``:
no rank spins forever on a dead peer.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import time

import numpy as np
import torch

LINE = 64  # bytes per rank flag: no two ranks' flags share a cache line
SPIN_S = 50e-6  # busy-poll this long, then yield the core between polls
SHM_DIR = "/dev/shm"


class ShmCollectives:
    """Rank ``rank`` of ``size`` over the segment ``name`` (rank 0 creates it; the others map
    it after a barrier; rank 0 unlinks the name once all have, so nothing is left behind)."""

    def __init__(self, rank: int, size: int, name: str, slot_bytes: int, timeout_s: float):
        self.rank, self.size, self.slot_bytes, self.timeout_s = rank, size, slot_bytes, timeout_s
        self.path = os.path.join(SHM_DIR, name)
        self.total = LINE * size + 2 * size * slot_bytes
        self.seq = 0
        self._map: mmap.mmap | None = None

    def create(self) -> None:
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, self.total)
            self._open(fd)
        finally:
            os.close(fd)

    def attach(self) -> None:
        fd = os.open(self.path, os.O_RDWR)
        try:
            self._open(fd)
        finally:
            os.close(fd)

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def _open(self, fd: int) -> None:
        self._map = mmap.mmap(fd, self.total)
        raw = np.frombuffer(self._map, dtype=np.uint8)
        self.flags = raw[: LINE * self.size].view(np.int64)[:: LINE // 8]
        data = torch.from_numpy(raw[LINE * self.size :])
        self.slots = data.view(2, self.size, self.slot_bytes)

    def close(self) -> None:
        self.flags = self.slots = None
        if self._map is not None:
            # a view still alive (BufferError): the mapping goes with the process
            with contextlib.suppress(BufferError):
                self._map.close()
            self._map = None

    # -- the barrier --

    def _arrive(self) -> torch.Tensor:
        """Next call's set; waits until every rank is through the previous call."""
        self.seq += 1
        return self.slots[self.seq % 2]

    def _publish_and_wait(self) -> None:
        self.flags[self.rank] = self.seq  # after the slot copy: x86 keeps stores in order
        start = time.monotonic()
        spins = 0
        while int(self.flags.min()) < self.seq:
            spins += 1
            if spins & 63 == 0:
                waited = time.monotonic() - start
                if waited > SPIN_S:
                    os.sched_yield()
                if waited > self.timeout_s:
                    late = [r for r in range(self.size) if self.flags[r] < self.seq]
                    raise TimeoutError(
                        f"shared-memory collective {self.seq}: rank(s) {late} did not arrive "
                        f"in {self.timeout_s:.0f} s"
                    )

    def _chunks(self, flat: torch.Tensor):
        per = self.slot_bytes // flat.element_size()
        for start in range(0, flat.numel(), per):
            yield flat[start : start + per]

    @staticmethod
    def _view(slot: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return slot[: like.numel() * like.element_size()].view(like.dtype)

    # -- collectives --

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` (contiguous) over the ranks, in place."""
        for chunk in self._chunks(t.view(-1)):
            slots = self._arrive()
            self._view(slots[self.rank], chunk).copy_(chunk)
            self._publish_and_wait()
            parts = [self._view(slots[r], chunk) for r in range(self.size)]
            if self.size == 2:
                torch.add(parts[0], parts[1], out=chunk)  # one rounding: fp32 sum's bits
            else:
                acc = parts[0].to(torch.float32, copy=True)  # never the slot itself
                for p in parts[1:]:
                    acc += p.float()
                chunk.copy_(acc)
        return t

    def fits(self, t: torch.Tensor) -> bool:
        """Whether ``gather_last`` can take ``t`` (one slot; larger ones go through gloo)."""
        return t.numel() * t.element_size() <= self.slot_bytes

    def gather_last(self, t: torch.Tensor) -> torch.Tensor | None:
        """The ranks' ``t`` (contiguous, ``fits``) side by side along the last dim on rank
        0; None elsewhere."""
        slots = self._arrive()
        self._view(slots[self.rank], t).copy_(t.view(-1))
        self._publish_and_wait()
        if self.rank:
            return None
        return torch.cat([self._view(slots[r], t).view(t.shape) for r in range(self.size)], -1)

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``t`` (contiguous) on every rank, in place."""
        for chunk in self._chunks(t.view(-1)):
            slots = self._arrive()
            if self.rank == 0:
                self._view(slots[0], chunk).copy_(chunk)
            self._publish_and_wait()
            if self.rank:
                chunk.copy_(self._view(slots[0], chunk))
        return t
