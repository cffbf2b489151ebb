"""``AsyncLLM``: the frontend's handle on an engine-core process (ZeroMQ + msgpack)."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator

import msgspec
import zmq
import zmq.asyncio

from epdserve.engine.config import EngineConfig, encode_config
from epdserve.engine.core.core_proc import ABORT, ADD, LORA, READY
from epdserve.engine.core.engine_core import EngineCoreRequest
from epdserve.engine.core.interfaces import (
    MISSING_ITEM_STATUS,
    EngineCoreOutputs,
    SchedulerStats,
)
from epdserve.engine.core.pixel_cache import PixelSender
from epdserve.engine.core.step_guard import injected_fault, maybe_fail
from epdserve.engine.cpus import core_threads_env
from epdserve.engine.inputs.prompt import ProcessedPrompt
from epdserve.engine.outputs.output_processor import RequestState, StreamOutput, fan_out
from epdserve.engine.sampling_params import SamplingParams
from epdserve.engine.tokenizer import TokenizerInfo

log = logging.getLogger("epdserve.frontend")


# the request-errors metric's cause of a core's error output, by its status (else "rejected")
CORE_ERROR_CAUSES = {500: "engine_step", MISSING_ITEM_STATUS: "encoder_output_missing"}


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; requests cannot be served."""


class RequestFailedError(RuntimeError):
    """One request failed (the engine refused or could not serve it); others go on."""

    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status


class AsyncLLM:
    def __init__(self, config: EngineConfig, metrics=None, startup_timeout: float = 300.0):
        self.config = config
        self.tokenizer = TokenizerInfo(config.model)
        self.metrics = metrics  # epdserve.engine.metrics.EngineMetrics or None
        self.startup_timeout = startup_timeout
        self.states: dict[str, RequestState] = {}  # request id -> state
        self.child_to_state: dict[str, RequestState] = {}
        self.dead: str | None = None
        self.proc: subprocess.Popen | None = None
        self.max_model_len = 0
        self.num_blocks = 0
        self.stats = SchedulerStats()
        self._tasks: list[asyncio.Task] = []
        self._encode = msgspec.msgpack.Encoder()
        self._decode = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self.pixels = PixelSender()  # mirrors the core's PixelReceiver

    # --- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        self._tmp = tempfile.mkdtemp(prefix="epdserve-")
        in_addr, out_addr = f"ipc://{self._tmp}/in.ipc", f"ipc://{self._tmp}/out.ipc"
        self.ctx = zmq.asyncio.Context()
        self.input = self.ctx.socket(zmq.ROUTER)
        self.input.setsockopt(zmq.LINGER, 0)
        self.input.bind(in_addr)
        self.output = self.ctx.socket(zmq.PULL)
        self.output.setsockopt(zmq.LINGER, 0)
        self.output.bind(out_addr)
        cmd = [sys.executable, "-m", "epdserve.engine.core.core_proc"]
        cmd += ["--input", in_addr, "--output", out_addr]
        # Its own session: a signal to the server's process group (a terminal's Ctrl-C, a
        # runtime signalling the group) reaches only this process, which drains its streams
        # and then stops the core; the core still dies with this process (PDEATHSIG).
        self.proc = subprocess.Popen(
            cmd,
            env={**os.environ, **core_threads_env(self.config.model)},
            start_new_session=True,
            stdin=subprocess.PIPE,
        )
        # the config on stdin, not argv: a store URL's password must not show in `ps`
        try:
            self.proc.stdin.write(encode_config(self.config))
            self.proc.stdin.close()
        except BrokenPipeError:  # it died at once; _wait_ready reports its exit
            pass
        await self._wait_ready()
        self._tasks = [
            asyncio.create_task(self._output_loop()),
            asyncio.create_task(self._watch_process()),
        ]
        for task in self._tasks:
            task.add_done_callback(self._task_ended)

    def _task_ended(self, task: asyncio.Task) -> None:
        """The output loop and the watcher must never end silently: the pod is unusable."""
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.error("frontend task %s failed", task.get_coro().__name__, exc_info=exc)
            self._mark_dead(f"frontend output handling failed ({type(exc).__name__}: {exc})")

    async def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EngineDeadError(
                    f"engine core exited with code {self.proc.returncode} during start-up"
                )
            if await self.input.poll(200):
                identity, kind, payload = await self.input.recv_multipart()
                if kind == READY:
                    self.core_identity = identity
                    info = msgspec.msgpack.decode(payload)
                    self.max_model_len, self.num_blocks = info["max_model_len"], info["num_blocks"]
                    return
        raise EngineDeadError("engine core did not become ready in time")

    async def _watch_process(self) -> None:
        while self.proc.poll() is None:
            await asyncio.sleep(0.2)
        self._mark_dead(f"engine core process exited with code {self.proc.returncode}")

    def _mark_dead(self, reason: str) -> None:
        if self.dead:
            return
        self.dead = reason
        log.error("%s; failing %d in-flight requests", reason, len(self.states))
        for state in list(self.states.values()):
            # 500, not 503: a request in flight may be what ended the core, so a router
            # must not retry it on the next pod
            state.fail(f"the engine core died while serving this request: {reason}", 500)

    async def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.ctx.destroy(linger=0)
        shutil.rmtree(self._tmp, ignore_errors=True)  # the sockets' folder

    @property
    def healthy(self) -> bool:
        return self.dead is None and self.proc is not None and self.proc.poll() is None

    # --- requests ----------------------------------------------------------------------
    @property
    def num_in_flight(self) -> int:
        """Requests being served now."""
        return len(self.states)

    async def generate(
        self,
        prompt: ProcessedPrompt,
        params: SamplingParams,
        request_id: str | None = None,
        kv_transfer_params: dict | None = None,
        cache_salt: str | None = None,
        label: str | None = None,
        lora_request=None,  # epdserve.engine.lora.LoRARequest: its adapter
        priority: int = 0,  # lower is served earlier (--scheduling-policy priority)
        client: str | None = None,  # who sent it: the core's grammar compiles take turns by it
    ) -> AsyncIterator[StreamOutput]:
        """Stream a request's outputs; cancelling the iteration aborts the request.
        ``request_id`` must be the server's own (unique); ``label`` is the client's
        X-Request-Id, carried to the core for its logs."""
        if self.dead:
            raise EngineDeadError(self.dead)
        request_id = request_id or uuid.uuid4().hex
        state, children = fan_out(
            request_id, params, self.tokenizer, time.monotonic(), self.config.stream_interval
        )
        if request_id in self.states or any(c in self.child_to_state for c, _ in children):
            raise RequestFailedError(f"request id {request_id} is already in flight", 500)
        state.label = label  # for the output loop's test fault injection
        # the caller made the pixels the core lacked (OpenAIServing.prepare_chat, off the
        # loop); an image evicted since then is made at the send: rare, and still right
        self.states[request_id] = state
        for child_id, child_params in children:
            self.child_to_state[child_id] = state
            req = EngineCoreRequest(
                child_id,
                prompt.token_ids,
                child_params,
                None,
                time.monotonic(),
                kv_transfer_params,
                self.pixels.features(prompt.items),  # no await between this and the send
                cache_salt,
                label,
                lora_request,
                priority,
                client,
            )
            frame = self._encode.encode(req)
            await self.input.send_multipart([self.core_identity, ADD, frame])
            if self.metrics:
                self.metrics.core_input_bytes.inc(len(frame))
        for item in prompt.items:  # the core holds the pixels now; this process needs none
            item.source = None
        if self.metrics:
            self.metrics.on_request_added(len(prompt.token_ids), params)
        try:
            while True:
                out = await state.get()
                yield out
                if out.finished:
                    if out.error:
                        raise RequestFailedError(out.error, state.error_status)
                    break
        finally:
            self._forget(state, [c for c, _ in children], finished=state.finished)

    def _forget(self, state: RequestState, children: list[str], finished: bool) -> None:
        self.states.pop(state.request_id, None)
        unfinished = [
            c
            for c in children
            if self.child_to_state.pop(c, None) is not None and state.seqs[c].finish_reason is None
        ]
        if unfinished and not self.dead:
            asyncio.get_running_loop().create_task(self._abort(unfinished))
        if self.metrics and finished and not state.error:
            self.metrics.on_request_finished(state)
        elif self.metrics and state.error:
            self.metrics.on_request_error(state.error_cause)

    async def send_lora(self, op: str, lora) -> None:
        """Tell the core of an adapter: ``add`` (read it now) or ``remove`` (drop it)."""
        from epdserve.engine.lora.core_side import LoRAMessage

        if self.healthy:
            frame = self._encode.encode(LoRAMessage(op, lora))
            await self.input.send_multipart([self.core_identity, LORA, frame])

    async def _abort(self, child_ids: list[str]) -> None:
        await self.input.send_multipart([self.core_identity, ABORT, self._encode.encode(child_ids)])

    async def _output_loop(self) -> None:
        while True:
            frames = await self.output.recv()
            batch = self._decode.decode(frames)
            now = time.monotonic()
            stopped = []
            faults = injected_fault("detokenize") is not None  # tests only
            for out in batch.outputs:
                state = self.child_to_state.get(out.request_id)
                if state is None:
                    continue
                try:
                    if faults:
                        maybe_fail("detokenize", (out.request_id,), lambda _, s=state: s.label)
                    if state.process(out):
                        stopped.append(out.request_id)
                except Exception as exc:  # this request's output is broken, not the others'
                    log.exception("processing output of request %s failed", out.request_id)
                    state.fail(f"output processing failed ({type(exc).__name__}: {exc})", 500)
                    state.error_cause = "output_processing"
                    continue
                if out.error is not None:
                    state.error_cause = CORE_ERROR_CAUSES.get(out.error_status, "rejected")
                if self.metrics:
                    self.metrics.on_tokens(state, len(out.new_token_ids), now)
            if stopped:
                await self._abort(stopped)
            if batch.stats is not None:
                self.stats = batch.stats
                if self.metrics:
                    self.metrics.on_stats(batch.stats)
