"""One rank of ``test_shm_collectives.py`` (run as a process): ``RANK SIZE NAME MODE``; prints
its results as one JSON line."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from epdserve.engine.worker.shm_collectives import ShmCollectives


def main(rank: int, size: int, name: str, mode: str) -> None:
    shm = ShmCollectives(rank, size, name, slot_bytes=256, timeout_s=1.5)
    if rank == 0:
        shm.create()
    else:
        wait_until(lambda: os.path.exists(shm.path))  # rank 0 creates it
        shm.attach()
    # a test has no gloo barrier: the 1.5 s deadline starts once every rank is here (ranks
    # start seconds apart on a loaded 2-CPU machine, importing torch)
    ready = Path(tempfile.gettempdir()) / f"{name}.ready"
    (ready / str(rank)).parent.mkdir(exist_ok=True)
    (ready / str(rank)).touch()
    wait_until(lambda: len(list(ready.iterdir())) == size)
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
        shutil.rmtree(ready, ignore_errors=True)
    print(json.dumps(out), flush=True)


def wait_until(predicate, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("the other ranks did not start")
        time.sleep(0.01)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
