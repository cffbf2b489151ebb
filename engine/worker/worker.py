"""One rank of the execution layer (DESIGN.md §10): a ``Worker`` owns a device and everything
on it: the model, the vision encoder, the paged KV cache and the ``ModelRunner`` over it, and
the worker halves of the KV and encoder-cache connectors and of LoRA.

It takes only messages that cross the executor (``KVCacheSpec``, ``KVCacheConfig``,
``SchedulerOutput``, ``LoRASlotLoad``: msgpack-able) and returns only such messages, so the
same class serves in the core's process (``uni``) or in a process of its own. Its counters go
back with the step's output (``ModelRunnerOutput.worker_stats``); nothing reads its state.
"""

from __future__ import annotations

import logging

import torch

from epdserve.connectors.kv_connector import KVConnectorRole
from epdserve.engine.config import EngineConfig
from epdserve.engine.core.interfaces import (
    KVCacheConfig,
    ModelRunnerOutput,
    SchedulerOutput,
    WorkerStats,
)
from epdserve.engine.core.kv_cache_groups import KVCacheSpec
from epdserve.engine.core.step_guard import maybe_fail
from epdserve.engine.executor.connector_halves import encoder_connector_worker, kv_connector_half
from epdserve.engine.kv_transfer.setup import store_rejections
from epdserve.engine.lora.slots import LoRASlotLoad, LoRASlots
from epdserve.engine.malloc import tune_heap
from epdserve.engine.models.config import load_model_config
from epdserve.engine.models.layers import Shard
from epdserve.engine.models.loader import load_model, load_vision_encoder
from epdserve.engine.worker.model_runner import ModelRunner
from epdserve.engine.worker.parallel import TPGroup, init_tp_group, step_timeout_s
from epdserve.engine.worker.profiling import gpu_kv_budget
from epdserve.kernels.fp8_kv import StoredKVDtype

log = logging.getLogger("epdserve.worker")

# what a host's KV cache may take when ``kv_cache_memory`` is not given: host memory is not
# profiled, the core sizes the cache for ``max_num_seqs`` sequences up to this
DEFAULT_KV_CACHE_CAP = 1 << 30


class Worker:
    """A rank's device and what it holds. Methods in the order the core calls them:
    ``load_model``, ``determine_available_memory``, ``initialize_kv_cache``, then per step
    ``add_lora``/``remove_lora`` and ``execute_model``, and ``shutdown`` last."""

    def __init__(self, config: EngineConfig, rank: int = 0, init_method: str | None = None):
        """``init_method``: where the ranks of a tensor-parallel group meet (``tcp://...``)."""
        assert config.max_model_len is not None, "the core resolves max_model_len first"
        self.config, self.rank, self.init_method = config, rank, init_method
        self.device = rank_device(config.device, rank, config.tensor_parallel_size)
        self.tp = TPGroup()
        self.dtype = getattr(torch, config.dtype)
        self.model_cfg = load_model_config(config.model)
        self.model = self.vision_encoder = self.runner = None
        self.kv_connector = self.ec_connector = None
        self.lora: LoRASlots | None = None
        self._last_stats = WorkerStats()

    def load_model(self) -> None:
        """Load the weights (and the vision tower of an image+text model) onto the device and
        open the connectors' worker halves."""
        cfg, model_cfg = self.config, self.model_cfg
        torch.manual_seed(cfg.seed)
        tune_heap()  # activations stay in the heap between steps (engine/malloc.py)
        size = cfg.tensor_parallel_size
        if size > 1:
            self.tp = init_tp_group(
                self.rank, size, self.init_method, self.device, step_timeout_s()
            )
        max_len = max(cfg.max_model_len, model_cfg.max_position_embeddings)
        self.model = load_model(
            cfg.model,
            self.dtype,
            self.device,
            max_len,
            cfg.attention_backend,
            self.tp,
            cfg.quantization,
        )
        if self.tp.is_output:  # images are encoded, loaded and stored by the output rank
            self.vision_encoder = load_vision_encoder(cfg.model, self.dtype, self.device)
            self.ec_connector = encoder_connector_worker(cfg)
        self.kv_connector = kv_connector_half(cfg, model_cfg, KVConnectorRole.WORKER, self.tp)
        if cfg.enable_lora:
            shard = Shard(self.rank, size)
            self.lora = LoRASlots(
                model_cfg, cfg.max_loras, cfg.max_lora_rank, self.dtype, self.device, shard
            )

    def determine_available_memory(self, spec: KVCacheSpec) -> int:
        """Bytes this device can give a KV cache laid out as ``spec``: on CUDA what the
        weights and a profiled step at the largest batch leave of ``gpu_memory_utilization``
        (may be negative); on a host, a fixed cap."""
        if self.device.type != "cuda":
            return DEFAULT_KV_CACHE_CAP
        cfg = self.config
        return gpu_kv_budget(self.model, spec, cfg, cfg.max_model_len, self.device)

    def initialize_kv_cache(self, kv: KVCacheConfig) -> None:
        """Allocate the paged cache of ``kv.num_blocks`` blocks and the runner over it."""
        cfg = self.config
        kv_dtype = getattr(torch, cfg.kv_storage_dtype)
        if kv_dtype != self.dtype:  # --kv-cache-dtype fp8: written rounded, read back up
            self.model.kernels = StoredKVDtype(self.model.kernels, kv_dtype)
        self.runner = ModelRunner(
            self.model,
            kv.num_blocks,
            cfg.block_size,
            cfg.max_num_seqs,
            cfg.max_model_len,
            self.kv_connector,
            self.vision_encoder,
            self.ec_connector,
            kv.spec,
            self.lora,
            kv_dtype,
            cfg.max_num_batched_tokens,
        )

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step; the output carries this worker's counters when they changed. A step
        that raises carries them on the exception (``worker_stats``): what it encoded or
        loaded before the fault is counted too."""
        try:
            for stage in ("ranks", f"rank{self.rank}"):  # tests: EPDSERVE_INJECT_FAULT
                maybe_fail(stage, sched.num_scheduled_tokens)
            out = self.runner.execute_model(sched)
        except Exception as exc:
            exc.worker_stats = self._changed_stats()
            raise
        out.worker_stats = self._changed_stats()
        return out

    def _changed_stats(self) -> WorkerStats | None:
        if self.vision_encoder is None and self.kv_connector is None:
            return None  # nothing counted here: no cost per step
        stats = self._stats()
        if stats == self._last_stats:
            return None
        self._last_stats = stats
        return stats

    def _stats(self) -> WorkerStats:
        stats = WorkerStats()
        outputs = self.runner.encoder_outputs
        if outputs is not None:
            stats.encoder_runs, stats.encoder_loads = outputs.num_runs, outputs.num_loads
        kv = [self.kv_connector] if self.kv_connector is not None else []
        if kv:
            stats.kv_save_failures = kv[0].stats().save_failures
        stats.store_rejections = store_rejections(kv, self.ec_connector)
        return stats

    def add_lora(self, load: LoRASlotLoad) -> None:
        """Write an adapter onto its device slot (before the step that first uses it)."""
        assert self.lora is not None, "add_lora on a worker without LoRA"
        self.lora.load(load)

    def remove_lora(self, slot: int) -> None:
        """The adapter on ``slot`` is gone: zero its scaling."""
        assert self.lora is not None, "remove_lora on a worker without LoRA"
        self.lora.clear(slot)

    def shutdown(self) -> None:
        """Finish the connectors' background work and release their stores."""
        for connector in (self.kv_connector, self.ec_connector):
            if connector is not None:
                connector.close()
        self.tp.close()


def rank_device(device: str, rank: int, size: int) -> torch.device:
    """Rank ``rank``'s device: the host for every CPU rank, GPU ``rank`` of ``cuda`` (a rank
    process sees the pod's GPUs)."""
    if size == 1 or not device.startswith("cuda"):
        return torch.device(device)
    base = int(device.partition(":")[2] or 0)
    torch.cuda.set_device(base + rank)
    return torch.device(f"cuda:{base + rank}")
