"""CPU ranks' shared-memory collectives: exact sums in chunks larger than a slot, the same
bits on every rank, gather and broadcast, and a bounded wait for a rank that never comes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

RANK = Path(__file__).with_name("shm_collectives_rank.py")


def run_ranks(size: int, mode: str = "ok") -> list[dict]:
    name = f"epdserve-test-{os.getpid()}-{size}-{mode}"
    procs = [
        subprocess.Popen(
            [sys.executable, str(RANK), str(r), str(size), name, mode],
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(size)
    ]
    outs = [p.communicate(timeout=60)[0] for p in procs]
    assert not os.path.exists(f"/dev/shm/{name}")
    return [json.loads(o) if o.strip() else {} for o in outs]


@pytest.mark.parametrize("size", [2, 3])
def test_collectives_agree_on_every_rank(size):
    results = run_ranks(size)
    factor = sum(r + 1 for r in range(size))
    expected = (torch.arange(300, dtype=torch.float32) * factor).tolist()
    for res in results:
        assert res["sum"] == expected
        assert res["bf16"] == results[0]["bf16"]  # the same bits everywhere
        assert res["bcast"] == [7.0] * 100
    assert results[0]["gather"] == [[float(r) for r in range(size) for _ in range(3)]] * 2
    assert all(res["gather"] is None for res in results[1:])


def test_a_rank_that_never_arrives_times_out_naming_it():
    results = run_ranks(2, "late")
    assert "rank(s) [1] did not arrive" in results[0]["timeout"]
