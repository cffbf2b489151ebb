"""How many KV-cache blocks an engine core allocates (every rank allocates the same number)."""

from __future__ import annotations

import torch

from epdserve.engine.config import EngineConfig
from epdserve.engine.core.kv_cache_groups import KVCacheSpec
from epdserve.engine.models.config import ModelConfig
from epdserve.engine.models.layers import Shard, shard_config


def num_kv_blocks(
    cfg: EngineConfig, spec: KVCacheSpec, executor, model_cfg: ModelConfig, max_model_len: int
) -> int:
    """Blocks of ``spec``: ``--kv-cache-memory`` when given; on CUDA what the weights and a
    profiled largest step leave; on a host enough for ``max_num_seqs`` sequences, up to the
    worker's cap. Refuses (``ValueError``, naming the flag) fewer than one sequence needs."""
    itemsize = getattr(torch, cfg.kv_storage_dtype).itemsize  # --kv-cache-dtype fp8: 1
    kv_size = shard_config(model_cfg, Shard(0, cfg.tensor_parallel_size)).kv_size  # a rank's
    per_block = spec.slots * 2 * cfg.block_size * kv_size * itemsize
    need = 1 + spec.blocks_per_request(cfg.block_size, max_model_len, cfg.max_num_batched_tokens)
    if cfg.kv_cache_memory is not None:
        num = cfg.kv_cache_memory // per_block
    elif cfg.device.startswith("cuda"):  # what the weights and a profiled largest step leave
        budget = executor.determine_available_memory(spec)
        num = max(budget, 0) // per_block
        if num < need:
            raise ValueError(
                f"gpu_memory_utilization: {cfg.gpu_memory_utilization} leaves "
                f"{max(budget, 0)} bytes for the KV cache, fewer than one "
                f"max_model_len={max_model_len} sequence needs ({need} blocks of "
                f"{per_block} bytes); raise it, or lower max_model_len or "
                "max_num_batched_tokens"
            )
    else:  # a host: enough for max_num_seqs sequences, up to the worker's cap
        cap = executor.determine_available_memory(spec)
        num = min(cfg.max_num_seqs * (need - 1) + 1, cap // per_block)
    if num < need:
        raise ValueError(
            f"kv_cache_memory: {num} blocks of {per_block} bytes cannot hold one "
            f"max_model_len={max_model_len} sequence (needs {need}); "
            "raise kv_cache_memory or lower max_model_len"
        )
    return int(num)
