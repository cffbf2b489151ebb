"""How much KV cache a GPU can hold (vLLM's ``--gpu-memory-utilization``).

One throwaway step at the largest batch the scheduler may build (``max_num_batched_tokens``
tokens, one prompt) runs through a small temporary runner; its peak memory (weights plus
activations) and whatever else holds the device (the CUDA context, other processes) are
subtracted from ``utilization`` x the device's memory. The rest is the KV cache's.
"""

from __future__ import annotations

import logging

import torch

from epdserve.engine.core.interfaces import CachedRequestData, NewRequestData, SchedulerOutput
from epdserve.engine.sampling_params import SamplingParams

log = logging.getLogger("epdserve.core")


def kv_budget_bytes(total: int, free: int, reserved: int, peak: int, utilization: float) -> int:
    """Bytes left for the KV cache: ``utilization`` of the device, less the profiled peak of
    this process and what others hold (``total - free - reserved``: not torch's, not ours)."""
    others = max(0, total - free - reserved)
    return int(total * utilization) - peak - others


def run_profile_step(model, spec, block_size: int, num_tokens: int, max_model_len: int) -> None:
    """One step of ``num_tokens`` prompt tokens (and its sampling) on a temporary runner."""
    from epdserve.engine.worker.model_runner import ModelRunner

    num_tokens = max(2, min(num_tokens, max_model_len - 1))
    blocks = -(-num_tokens // block_size)
    runner = ModelRunner(model, blocks + 1, block_size, 1, max_model_len, spec=spec)
    table = [list(range(1, blocks + 1)) for _ in spec.groups]
    request = NewRequestData(
        "profile", [1] * num_tokens, SamplingParams(max_tokens=1), table, 0, num_tokens
    )
    sched = SchedulerOutput(
        [request], CachedRequestData([], [], []), {"profile": num_tokens}, num_tokens, []
    )
    runner.execute_model(sched)


def gpu_kv_budget(model, spec, config, max_model_len: int, device: torch.device) -> int:
    """The KV cache's bytes on ``device`` after profiling one step at the largest batch."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    run_profile_step(
        model,
        spec,
        config.block_size,
        config.max_num_batched_tokens,
        max_model_len,
    )
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    budget = kv_budget_bytes(
        total, free, torch.cuda.memory_reserved(device), peak, config.gpu_memory_utilization
    )
    log.info(
        "GPU memory: %.2f GiB total, profiled peak %.2f GiB; %.2f GiB for the KV cache "
        "(gpu_memory_utilization %.2f)",
        total / 2**30,
        peak / 2**30,
        max(budget, 0) / 2**30,
        config.gpu_memory_utilization,
    )
    return budget
