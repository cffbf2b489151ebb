"""The engine core of an ``--role encoder`` pod: the vision encoder only, no language model
and no KV cache. Each request's images are encoded (unless the shared store already has
them) and saved through the encoder-cache connector; the request then finishes at once,
answering with the identifiers it stored."""

from __future__ import annotations

import logging
import time

import torch

from epdserve.engine.config import EngineConfig
from epdserve.engine.core.interfaces import (
    MISSING_ITEM_STATUS,
    EngineCoreOutput,
    MissingPixelsError,
    SchedulerStats,
)
from epdserve.engine.core.step_guard import maybe_fail
from epdserve.engine.kv_transfer.setup import create_encoder_connector, resolve_identity
from epdserve.engine.models.loader import load_vision_encoder
from epdserve.engine.worker.mm_inputs import EncoderOutputs

log = logging.getLogger("epdserve.core")


class EncoderCore:
    """Same loop interface as ``EngineCore`` (add / abort / step / stats)."""

    def __init__(self, config: EngineConfig):
        config = self.config = resolve_identity(config)  # the checkpoint's digest, once
        dtype = getattr(torch, config.dtype)
        encoder = load_vision_encoder(config.model, dtype, torch.device(config.device))
        if encoder is None:
            raise ValueError(
                "role: encoder needs an image+text model (this one has no vision tower)"
            )
        self.ec_connector = create_encoder_connector(config)
        self.outputs = EncoderOutputs(encoder, self.ec_connector)
        self.pending: dict = {}
        self.max_model_len = 1 << 20
        self.num_blocks = 0
        self.step_count = 0
        self.failed_steps = 0
        self.model_cpu_seconds = 0.0  # process CPU time spent encoding

    def add_request(self, req) -> None:
        if not req.mm_features:
            raise ValueError("prompt: an encoder pod serves requests with images only")
        if req.request_id in self.pending:  # the id is the server's: a second one is a bug
            raise ValueError(f"request_id: {req.request_id!r} is already in use")
        for i, f in enumerate(req.mm_features):
            f.check_buffer(i)
        self.pending[req.request_id] = req

    def abort_requests(self, request_ids: list[str]) -> None:
        for req_id in request_ids:
            self.pending.pop(req_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.pending)

    def step(self) -> list[EngineCoreOutput]:
        reqs, self.pending = list(self.pending.values()), {}
        self.step_count += 1
        try:
            self._encode(reqs)
            return [self._done(r) for r in reqs]
        except Exception as exc:  # one bad image must not fail the batch: retry one by one
            self.failed_steps += 1
            log.error(
                "encoding a batch of %d requests failed; retrying each", len(reqs), exc_info=exc
            )
        outputs = []
        for r in reqs:
            try:
                self._encode([r])
                outputs.append(self._done(r))
            except Exception as exc:
                log.error("request %s failed", r.request_id, exc_info=exc)
                outputs.append(
                    EngineCoreOutput(
                        r.request_id,
                        [],
                        finish_reason="abort",
                        error="the engine failed while serving this request "
                        f"({type(exc).__name__}: {exc})",
                        error_status=MISSING_ITEM_STATUS
                        if isinstance(exc, MissingPixelsError)
                        else 500,
                    )
                )
        return outputs

    def _encode(self, reqs: list) -> None:
        maybe_fail("execute", [r.request_id for r in reqs])
        features = {f.identifier: f for r in reqs for f in r.mm_features}
        stored = self.ec_connector.stored(list(features))
        todo = [f for f, found in zip(features.values(), stored, strict=True) if not found]
        cpu = time.process_time()
        try:
            self.outputs.encode(todo)  # saves through the connector
        finally:
            self.model_cpu_seconds += time.process_time() - cpu
            self.outputs.free([f.identifier for f in todo])  # the store keeps them, not us

    @staticmethod
    def _done(r) -> EngineCoreOutput:
        return EngineCoreOutput(
            r.request_id,
            [],
            finish_reason="stop",
            ec_transfer_params={"mm_ids": [f.identifier for f in r.mm_features]},
        )

    def take_events(self) -> list:
        return []

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_waiting=len(self.pending),
            num_steps=self.step_count,
            encoder_runs=self.outputs.num_runs,
            failed_steps=self.failed_steps,
            model_cpu_seconds=self.model_cpu_seconds,
        )

    def close(self) -> None:
        self.ec_connector.close()
