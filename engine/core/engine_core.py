"""The engine core: ``step() = schedule → execute → update``, the model behind an executor."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

from epdserve.connectors.kv_connector import KVConnectorRole
from epdserve.engine.config import EngineConfig
from epdserve.engine.core.cpu_clock import ModelCpuClock
from epdserve.engine.core.hashing import BlockHasher, get_hash_fn, none_hash
from epdserve.engine.core.interfaces import (  # EngineCoreRequest: imported from here too
    EngineCoreOutput,
    EngineCoreRequest,
    KVCacheConfig,
    MMFeature,
    SchedulerStats,
    WorkerStats,
)
from epdserve.engine.core.kv_cache_groups import make_kv_cache_spec
from epdserve.engine.core.kv_cache_manager import KVCacheManager
from epdserve.engine.core.kv_sizing import num_kv_blocks
from epdserve.engine.core.mm_scheduling import EncoderScheduler, checked_mm_features
from epdserve.engine.core.overlap import IDLE_POLL_S, OverlappedSteps
from epdserve.engine.core.request import Request, RequestStatus
from epdserve.engine.core.scheduler import Scheduler
from epdserve.engine.core.step_guard import StepGuard, maybe_fail
from epdserve.engine.cpus import resolve_batched_tokens
from epdserve.engine.executor.base import create_executor
from epdserve.engine.executor.connector_halves import (
    encoder_connector_scheduler,
    kv_connector_half,
)
from epdserve.engine.executor.rank_messages import WorkerFailure
from epdserve.engine.kv_transfer.coordinator import KVTransferCoordinator
from epdserve.engine.kv_transfer.setup import resolve_identity, store_rejections
from epdserve.engine.lora import core_side as lora_core
from epdserve.engine.models.config import load_model_config
from epdserve.engine.models.siglip import VisionConfig
from epdserve.engine.structured.manager import StructuredOutputManager

log = logging.getLogger("epdserve.core")


class EngineCore:
    """Scheduler, KV cache manager and the connectors' scheduler halves around an executor:
    the core never touches the model, the KV tensors or a runner (DESIGN.md §10)."""

    def __init__(self, config: EngineConfig, executor_backend: str | None = None):
        config = self.config = resolve_identity(config)  # digest and hash seed, once
        model_cfg = load_model_config(config.model)
        budget = resolve_batched_tokens(config, model_cfg)  # on cpu: by model size
        config = self.config = replace(config, max_num_batched_tokens=budget)
        self.max_model_len = config.max_model_len or model_cfg.max_position_embeddings
        hybrid = not (config.disable_hybrid_kv_cache_manager or config.kv_transfer_config)
        self.kv_spec = make_kv_cache_spec(model_cfg.layer_windows(), hybrid)
        resolved = replace(config, max_model_len=self.max_model_len)
        self.executor = create_executor(resolved, executor_backend)
        try:
            self.num_blocks = num_kv_blocks(
                config, self.kv_spec, self.executor, model_cfg, self.max_model_len
            )
            self.executor.initialize_kv_cache(KVCacheConfig(self.num_blocks, self.kv_spec))
        except BaseException:  # a refused size: the workers' stores must not leak
            self.executor.shutdown()
            raise
        self.kv = KVCacheManager(
            self.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            config.enable_kv_events,
            self.kv_spec,
        )
        self.kv_connector = kv_connector_half(config, model_cfg, KVConnectorRole.SCHEDULER)
        coordinator = None
        if self.kv_connector is not None:
            can_load = config.kv_transfer_config.is_consumer
            coordinator = KVTransferCoordinator(self.kv_connector, self.kv, can_load)
        self.ec_connector = encoder_connector_scheduler(config)
        self.mm_tokens_per_image, encoder = None, None
        if model_cfg.multimodal:
            tokens = VisionConfig.from_hf(model_cfg.multimodal).mm_tokens_per_image
            self.mm_tokens_per_image = tokens
            budget = max(config.max_num_batched_tokens, tokens)
            encoder = EncoderScheduler(
                cache_tokens=max(budget, 8 * tokens),
                budget_tokens=budget,
                ec_connector=self.ec_connector,
            )
        self.lora = lora_core.make_manager(config, model_cfg)
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
        hash_fn = get_hash_fn(config.prefix_caching_hash_algo)
        self.hasher = BlockHasher(config.block_size, hash_fn, none_hash(hash_fn, config.hash_seed))
        self.eos_token_ids = model_cfg.eos_token_ids
        self.structured = StructuredOutputManager(
            config.model, model_cfg.vocab_size, list(self.eos_token_ids), config.max_num_seqs
        )
        self.step_count = 0
        self.model_cpu_seconds = 0.0  # process CPU time spent in execute_model
        self.cpu_clock = ModelCpuClock()  # read every 0.25 s at most, estimated between
        self.worker_stats = WorkerStats()  # the workers' counters, as of the last step
        self.guard = StepGuard()
        overlap = config.async_scheduling  # None: on where it pays (a CUDA device), see docs
        overlap = config.device.startswith("cuda") if overlap is None else overlap
        on = overlap and self.kv_connector is None  # P/D: loads and saves in turn
        self.overlap = OverlappedSteps(self) if on else None

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
        if self.mm_tokens_per_image is None:
            raise ValueError("mm_features: this model takes no image inputs")
        tokens = self.mm_tokens_per_image
        return checked_mm_features(req.mm_features, len(req.prompt_token_ids), tokens)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        busy = self.overlap is not None and self.overlap.inflight is not None
        return busy or self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        return self.sync_step() if self.overlap is None else self.overlap.step()

    def sync_step(self) -> list[EngineCoreOutput]:
        """schedule → execute → update, in turn (``async_scheduling`` off)."""
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
            if self.lora is not None and self.lora.slot_ops:
                lora_core.send_slot_ops(self.lora, self.executor)
            mark = self.cpu_clock.start()
            result = self.executor.execute_model(sched)
            self.model_cpu_seconds += self.cpu_clock.seconds(mark)
        except WorkerFailure:  # a rank is gone or out of step: the core cannot go on
            raise
        except Exception as exc:  # one request's fault must not end every request
            self.take_worker_stats(getattr(exc, "worker_stats", None))
            return self.guard.contain(self.scheduler, sched, exc)
        if not sched.total_num_scheduled_tokens:
            time.sleep(IDLE_POLL_S)  # only connector work in flight: poll, don't spin
        return self.apply_output(sched, result)

    def apply_output(self, sched, result, owners: list | None = None) -> list[EngineCoreOutput]:
        """A step's output applied: its requests' tokens, stops and outputs."""
        self.step_count += 1
        self.take_worker_stats(result.worker_stats)
        outputs = self.scheduler.update_from_output(sched, result, owners)
        if self.scheduler.admission_failures:
            outputs += self.scheduler.take_admission_failures()
        for req_id, exc in self.scheduler.update_failures:
            log.error("updating request %s failed", req_id, exc_info=exc)
            outputs += self.guard.fail(self.scheduler, [req_id], f"{type(exc).__name__}: {exc}")
        self.guard.passed(result)
        return outputs

    def take_worker_stats(self, stats: WorkerStats | None) -> None:
        if stats is not None:  # None: unchanged
            self.worker_stats = stats

    def close(self) -> None:
        if self.overlap is not None and self.overlap.inflight is not None:
            try:  # the step in flight ends before its worker does
                self.overlap.inflight.handle.result()
            except Exception:
                log.debug("the step in flight at close failed", exc_info=True)
        for half in (self.kv_connector, self.ec_connector, self.lora):
            if half is not None:
                half.close()
        self.structured.close()
        self.executor.shutdown()

    def take_events(self) -> list:
        """This step's KV events: the pod's own cache, then blocks its KV connector saved to
        the shared store."""
        events = self.kv.take_events()
        if self.kv_connector is not None:
            events += self.kv_connector.take_events()
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
        w = self.worker_stats  # the worker side encodes images and moves blocks
        if s.encoder is not None:
            stats.mm_queries, stats.mm_hits = s.encoder.cache.queries, s.encoder.cache.hits
            stats.encoder_runs, stats.encoder_loads = w.encoder_runs, w.encoder_loads
        stats.kv_save_failures = w.kv_save_failures
        if self.kv_connector is not None:
            stats.kv_save_failures += self.kv_connector.stats().save_failures
        if s.kv_transfer is not None:
            stats.external_queries = s.kv_transfer.queries
            stats.external_hits = s.kv_transfer.hits
            stats.kv_load_failures = s.kv_transfer.load_failures
        stats.store_rejections = merged_rejections(
            store_rejections([self.kv_connector] if self.kv_connector else [], None),
            w.store_rejections,
        )
        stats.model_cpu_seconds = self.model_cpu_seconds
        if self.lora is not None:
            stats.running_loras, stats.waiting_loras = s.adapter_names()
        return stats


def merged_rejections(*parts: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """Rejection counts of both halves, by kind and reason, summed."""
    out: dict[str, dict[str, int]] = {}
    for part in parts:
        for kind, reasons in part.items():
            bucket = out.setdefault(kind, {})
            for reason, n in reasons.items():
                bucket[reason] = bucket.get(reason, 0) + n
    return out
