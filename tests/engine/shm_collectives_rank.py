"""One rank of ``test_shm_collectives.py`` (run as a process): ``RANK SIZE NAME MODE``; prints
its results as one JSON line."""

from __future__ import annotations

import json
import sys
import time

import torch

from epdserve.engine.worker.shm_collectives import ShmCollectives


def main(rank: int, size: int, name: str, mode: str) -> None:
    shm = ShmCollectives(rank, size, name, slot_bytes=256, timeout_s=1.5)
    if rank == 0:
        shm.create()
    else:
        for _ in range(500):  # rank 0 creates it: a test has no gloo barrier
            try:
                shm.attach()
                break
            except FileNotFoundError:
                time.sleep(0.01)
    if mode == "late" and rank == size - 1:
        return  # never arrives
    out: dict = {}
    try:
        # 300 fp32 values: chunks of 64 (slot 256 bytes); integers: exact sums
        t = torch.arange(300, dtype=torch.float32) * (rank + 1)
        out["sum"] = shm.all_reduce(t).tolist()
        b = (torch.randn(200, generator=torch.Generator().manual_seed(rank))).to(torch.bfloat16)
        out["bf16"] = shm.all_reduce(b).float().tolist()
        g = shm.gather_last(torch.full((2, 3), float(rank)))
        out["gather"] = None if g is None else g.tolist()
        c = torch.full((100,), 7.0) if rank == 0 else torch.zeros(100)
        out["bcast"] = shm.broadcast(c).tolist()
    except TimeoutError as exc:
        out["timeout"] = str(exc)
    if rank == 0:
        shm.unlink()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
