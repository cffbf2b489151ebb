"""The engine core: ``step() = schedule → execute → update`` around one model."""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec
import torch

from epdserve.engine.config import EngineConfig
from epdserve.engine.core.hashing import BlockHasher, get_hash_fn, none_hash
from epdserve.engine.core.interfaces import EngineCoreOutput, MMFeature, SchedulerStats
from epdserve.engine.core.kv_cache_groups import make_kv_cache_spec
from epdserve.engine.core.kv_cache_manager import KVCacheManager
from epdserve.engine.core.mm_scheduling import EncoderScheduler, checked_mm_features
from epdserve.engine.core.request import Request, RequestStatus
from epdserve.engine.core.scheduler import Scheduler
from epdserve.engine.core.step_guard import StepGuard, maybe_fail
from epdserve.engine.kv_transfer.coordinator import KVTransferCoordinator
from epdserve.engine.kv_transfer.setup import (
    create_encoder_connector,
    create_kv_connectors,
    resolve_identity,
    store_rejections,
)
from epdserve.engine.lora import core_side as lora_core
from epdserve.engine.lora.request import LoRARequest
from epdserve.engine.malloc import tune_heap
from epdserve.engine.models.loader import load_model, load_vision_encoder
from epdserve.engine.sampling_params import SamplingParams
from epdserve.engine.structured.manager import StructuredOutputManager
from epdserve.engine.worker.model_runner import ModelRunner, kv_block_bytes
from epdserve.engine.worker.profiling import gpu_kv_budget

log = logging.getLogger("epdserve.core")

DEFAULT_KV_CACHE_CAP = 1 << 30
IDLE_POLL_S = 0.001


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = 0.0
    kv_transfer_params: dict[str, Any] | None = None
    mm_features: list[MMFeature] = []
    cache_salt: str | None = None  # tenant isolation: folded into the first block's hash
    label: str | None = None  # the client's X-Request-Id: logs and test fault injection only
    lora_request: LoRARequest | None = None  # its adapter (None: the base model)
    priority: int = 0  # lower is served earlier under --scheduling-policy priority
    client: str | None = None  # who sent it (the API's peer): grammar compiles take turns by it


class EngineCore:
    def __init__(self, config: EngineConfig):
        config = self.config = resolve_identity(config)  # digest and hash seed, once
        torch.manual_seed(config.seed)
        tune_heap()  # activations stay in the heap between steps (engine/malloc.py)
        dtype = getattr(torch, config.dtype)
        device = torch.device(config.device)
        from epdserve.engine.models.config import load_model_config

        model_cfg = load_model_config(config.model)
        self.max_model_len = config.max_model_len or model_cfg.max_position_embeddings
        self.model = load_model(
            config.model,
            dtype,
            device,
            max(self.max_model_len, model_cfg.max_position_embeddings),
            config.attention_backend,
        )
        hybrid = not (config.disable_hybrid_kv_cache_manager or config.kv_transfer_config)
        self.kv_spec = make_kv_cache_spec(model_cfg.layer_windows(), hybrid)
        self.num_blocks = self._num_blocks(dtype)
        self.kv = KVCacheManager(
            self.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            config.enable_kv_events,
            self.kv_spec,
        )
        connectors = create_kv_connectors(config, self._block_shape())
        self.kv_connectors = connectors or ()
        coordinator = None
        if connectors:
            can_load = config.kv_transfer_config.is_consumer
            coordinator = KVTransferCoordinator(connectors[0], self.kv, can_load)
        self.vision_encoder = load_vision_encoder(config.model, dtype, device)
        self.ec_connector = create_encoder_connector(config)
        encoder = None
        if self.vision_encoder is not None:
            tokens = self.vision_encoder.config.mm_tokens_per_image
            budget = max(config.max_num_batched_tokens, tokens)
            encoder = EncoderScheduler(
                cache_tokens=max(budget, 8 * tokens),
                budget_tokens=budget,
                ec_connector=self.ec_connector,
            )
        self.lora = lora_core.make_manager(config, self.model)
        self.scheduler = Scheduler(
            self.kv,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.max_model_len,
            coordinator,
            encoder,
            self.lora,
            config.scheduling_policy,
        )
        self.runner = ModelRunner(
            self.model,
            self.num_blocks,
            config.block_size,
            config.max_num_seqs,
            self.max_model_len,
            connectors[1] if connectors else None,
            self.vision_encoder,
            self.ec_connector,
            self.kv_spec,
            self.lora,
        )
        hash_fn = get_hash_fn(config.prefix_caching_hash_algo)
        self.hasher = BlockHasher(config.block_size, hash_fn, none_hash(hash_fn, config.hash_seed))
        self.eos_token_ids = model_cfg.eos_token_ids
        self.structured = StructuredOutputManager(
            config.model, model_cfg.vocab_size, list(self.eos_token_ids), config.max_num_seqs
        )
        self.step_count = 0
        self.model_cpu_seconds = 0.0  # process CPU time spent in execute_model
        self.guard = StepGuard()

    def _block_shape(self) -> tuple[int, ...]:
        cfg = self.model.config
        return (cfg.num_layers, 2, self.config.block_size, cfg.num_kv_heads, cfg.head_dim)

    def _num_blocks(self, dtype: torch.dtype) -> int:
        cfg = self.config
        per_block = kv_block_bytes(self.model, cfg.block_size, dtype, self.kv_spec.slots)
        need = 1 + self.kv_spec.blocks_per_request(
            cfg.block_size, self.max_model_len, cfg.max_num_batched_tokens
        )
        device = torch.device(cfg.device)
        if cfg.kv_cache_memory is not None:
            num = cfg.kv_cache_memory // per_block
        elif device.type == "cuda":  # what the weights and a profiled largest step leave
            budget = gpu_kv_budget(self.model, self.kv_spec, cfg, self.max_model_len, device)
            num = max(budget, 0) // per_block
            if num < need:
                raise ValueError(
                    f"gpu_memory_utilization: {cfg.gpu_memory_utilization} leaves "
                    f"{max(budget, 0)} bytes for the KV cache, fewer than one "
                    f"max_model_len={self.max_model_len} sequence needs ({need} blocks of "
                    f"{per_block} bytes); raise it, or lower max_model_len or "
                    "max_num_batched_tokens"
                )
        else:
            num = min(cfg.max_num_seqs * (need - 1) + 1, DEFAULT_KV_CACHE_CAP // per_block)
        if num < need:
            raise ValueError(
                f"kv_cache_memory: {num} blocks of {per_block} bytes cannot hold one "
                f"max_model_len={self.max_model_len} sequence (needs {need}); "
                "raise kv_cache_memory or lower max_model_len"
            )
        return int(num)

    def add_request(self, req: EngineCoreRequest) -> None:
        n = len(req.prompt_token_ids)
        if n == 0:
            raise ValueError("prompt: must contain at least one token")
        if n >= self.max_model_len:
            raise ValueError(
                f"prompt: {n} tokens leave no room to generate within "
                f"max_model_len={self.max_model_len}"
            )
        eos = (
            req.eos_token_id
            if req.eos_token_id is not None
            else (self.eos_token_ids[0] if self.eos_token_ids else None)
        )
        if req.request_id in self.scheduler.requests:  # before hashing a prompt for nothing
            raise ValueError(f"request_id: {req.request_id!r} is already in use")
        lora_core.check_request(self.lora, req.lora_request)
        request = Request(
            req.request_id,
            req.prompt_token_ids,
            req.sampling_params,
            eos,
            self.hasher,
            req.arrival_time or time.monotonic(),
            self._kv_transfer_params(req.kv_transfer_params),
            self._mm_features(req),
            req.cache_salt,
            req.lora_request,
            req.priority,
        )
        request.label = req.label
        self.scheduler.add_request(request)
        handed_over = (request.kv_transfer_params or {}).get("do_remote_decode")
        if req.sampling_params.structured_outputs is not None and not handed_over:
            # it waits in the queue until compiled; a prefill pod's one token is dropped (the
            # decode pod samples the first token itself), so it needs no grammar
            self.structured.add(request, req.client)

    def _kv_transfer_params(self, params: dict[str, Any] | None) -> dict[str, Any] | None:
        if self.config.role == "prefill" and not params:
            return {"do_remote_decode": True}  # a prefill pod always hands its blocks over
        return params

    def _mm_features(self, req: EngineCoreRequest) -> list[MMFeature]:
        if not req.mm_features:
            return []
        if self.vision_encoder is None:
            raise ValueError("mm_features: this model takes no image inputs")
        tokens = self.vision_encoder.config.mm_tokens_per_image
        return checked_mm_features(req.mm_features, len(req.prompt_token_ids), tokens)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        if not self.scheduler.has_unfinished_requests():
            return []
        self.guard.choose_solo(self.scheduler)
        try:
            sched = self.scheduler.schedule()
        except Exception as exc:  # a scheduler fault is contained like an execution fault
            return self.guard.contain_schedule(self.scheduler, exc)
        try:
            self.structured.fill(sched, self.scheduler.requests)
            maybe_fail("execute", sched.num_scheduled_tokens, self.scheduler.label_of)
            cpu = time.process_time()
            result = self.runner.execute_model(sched)
            self.model_cpu_seconds += time.process_time() - cpu
        except Exception as exc:  # one request's fault must not end every request
            return self.guard.contain(self.scheduler, sched, exc)
        self.step_count += 1
        if not sched.total_num_scheduled_tokens:
            time.sleep(IDLE_POLL_S)  # only connector work in flight: poll, don't spin
        outputs = self.scheduler.update_from_output(sched, result)
        if self.scheduler.admission_failures:
            outputs += self.scheduler.take_admission_failures()
        for req_id, exc in self.scheduler.update_failures:
            log.error("updating request %s failed", req_id, exc_info=exc)
            outputs += self.guard.fail(self.scheduler, [req_id], f"{type(exc).__name__}: {exc}")
        self.guard.passed(result)
        return outputs

    def close(self) -> None:
        for connector in self.kv_connectors:
            connector.close()
        if self.ec_connector is not None:
            self.ec_connector.close()
        if self.lora is not None:
            self.lora.close()
        self.structured.close()

    def take_events(self) -> list:
        """This step's KV events: the pod's own cache, then blocks its KV connector saved to
        the shared store."""
        events = self.kv.take_events()
        for connector in self.kv_connectors:
            events += connector.take_events()
        return events

    def stats(self) -> SchedulerStats:
        """Gauges now and cumulative counters, for the frontend's metrics."""
        s, kv = self.scheduler, self.kv
        stats = SchedulerStats(
            s.num_running(),
            s.num_waiting(),
            kv.usage,
            kv.prefix_queries,
            kv.prefix_hits,
            s.num_preemptions,
            self.step_count,
            prompt_tokens_by_source=list(s.prompt_sources),
            failed_steps=self.guard.num_failed_steps,
        )
        if s.encoder is not None:
            stats.mm_queries, stats.mm_hits = s.encoder.cache.queries, s.encoder.cache.hits
            stats.encoder_runs = self.runner.encoder_outputs.num_runs
            stats.encoder_loads = self.runner.encoder_outputs.num_loads
        for connector in self.kv_connectors:  # the worker side moves the blocks
            stats.kv_save_failures += connector.stats().save_failures
        if s.kv_transfer is not None:
            stats.external_queries = s.kv_transfer.queries
            stats.external_hits = s.kv_transfer.hits
            stats.kv_load_failures = s.kv_transfer.load_failures
        stats.store_rejections = store_rejections(self.kv_connectors, self.ec_connector)
        stats.model_cpu_seconds = self.model_cpu_seconds
        if self.lora is not None:
            stats.running_loras, stats.waiting_loras = s.adapter_names()
        return stats
