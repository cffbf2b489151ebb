"""KV-cache sizing from --gpu-memory-utilization: the arithmetic, and the profiling step (a
real forward on a temporary runner) on every model kind; on a GPU the same code measures."""

from __future__ import annotations

import pytest
import torch

from epdserve.engine.core.kv_cache_groups import make_kv_cache_spec
from epdserve.engine.models.config import load_model_config
from epdserve.engine.models.loader import load_model
from epdserve.engine.worker.profiling import kv_budget_bytes, run_profile_step

GiB = 1 << 30


def test_the_budget_is_the_utilized_share_less_peak_and_others():
    # 80 GiB device, 0.9 utilized: 72 GiB; our peak 20 GiB; others hold 2 GiB
    total, reserved, free = 80 * GiB, 22 * GiB, 56 * GiB
    assert kv_budget_bytes(total, free, reserved, 20 * GiB, 0.9) == 50 * GiB
    # nothing held by others: all of the utilized share but our peak
    assert kv_budget_bytes(total, total - reserved, reserved, 20 * GiB, 0.5) == 20 * GiB


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_the_profiling_step_runs_the_largest_batch_on_any_model_kind(models, arch):
    path = str(models.get(arch))
    cfg = load_model_config(path)
    model = load_model(path, torch.float32, torch.device("cpu"), 512)
    spec = make_kv_cache_spec(cfg.layer_windows(), True)
    run_profile_step(model, spec, 16, 300, 512)  # 300 tokens: many blocks, sliding windows
