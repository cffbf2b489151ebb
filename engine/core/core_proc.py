"""The engine-core process: ``python -m epdserve.engine.core.core_proc --input ADDR --output
ADDR``, its typed ``EngineConfig`` msgpack-encoded on stdin (``encode_config``; never on the
command line: the KV-transfer config may hold a store password, and every local user can read
a command line).

Talks to the frontend over ZeroMQ: a DEALER connected to the frontend's ROUTER receives
requests and aborts, a PUSH connected to its PULL sends outputs. Everything is msgpack;
nothing is pickled. Busy loop: drain input, ``schedule → execute → update``, send.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import signal
import sys
import time

import msgspec
import zmq

from epdserve.common.logs import setup_logging
from epdserve.connectors.kv_events import NullEventPublisher, create_publisher, to_wire_event
from epdserve.engine.config import decode_config
from epdserve.engine.core.encoder_core import EncoderCore
from epdserve.engine.core.engine_core import EngineCore, EngineCoreRequest
from epdserve.engine.core.interfaces import EngineCoreOutput, EngineCoreOutputs, SchedulerStats
from epdserve.engine.core.pixel_cache import PixelReceiver
from epdserve.engine.lora import core_side as lora_core

log = logging.getLogger("epdserve.core")

# request types, first frame after the envelope
ADD, ABORT, LORA, READY = b"\x00", b"\x01", b"\x02", b"READY"

_decode_add = msgspec.msgpack.Decoder(EngineCoreRequest)
_decode_abort = msgspec.msgpack.Decoder(list[str])
_decode_lora = msgspec.msgpack.Decoder(lora_core.LoRAMessage)
_encode = msgspec.msgpack.Encoder()
IDLE_WAIT_MS = 200  # an idle core's wait for input, and between its checks of its ranks


class CoreLoop:
    def __init__(self, core: EngineCore, input_sock, output_sock, publisher=None):
        self.core = core
        self.executor = getattr(core, "executor", None)  # an encoder core has none
        self.publisher = publisher or NullEventPublisher()
        self.input = input_sock
        self.output = output_sock
        self.poller = zmq.Poller()
        self.poller.register(input_sock, zmq.POLLIN)
        self.last_counts: tuple = ()
        self.rejected = 0  # requests refused at add (malformed or invalid)
        self.pixels = PixelReceiver()  # mirrors the API process's PixelSender
        self.publish_failures = 0

    def run(self) -> None:
        while True:
            idle = not self.core.has_unfinished_requests()
            if idle and self.executor is not None:
                self.executor.check_health()  # a rank that died while idle ends the core now
            self._drain_input(timeout_ms=IDLE_WAIT_MS if idle else 0)
            outputs = self.core.step()
            events = self.core.take_events()
            if events:  # one batch per step, in block-pool order
                self._publish(events)
            stats = self.core.stats()  # once per step: it decides the send and travels with it
            stats.kv_events = self._event_counts()
            if outputs or self._counts(stats) != self.last_counts:
                self._send(outputs, stats)

    def _publish(self, events: list) -> None:
        try:
            self.publisher.publish([to_wire_event(e) for e in events])
        except Exception:  # routers resync through replay; serving goes on
            self.publish_failures += 1
            log.exception("publishing %d KV events failed", len(events))

    def _drain_input(self, timeout_ms: int) -> None:
        if not self.poller.poll(timeout_ms):
            return
        while True:
            try:
                frames = self.input.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                log.warning("ignoring a message of %d frames", len(frames))
                continue
            self._handle(*frames)

    def _handle(self, kind: bytes, payload: bytes) -> None:
        if kind == ABORT:
            try:
                self.core.abort_requests(_decode_abort.decode(payload))
            except Exception:  # an abort that cannot be applied must not end the core
                log.exception("abort message ignored")
            return
        if kind == LORA:
            try:
                msg = _decode_lora.decode(payload)
                lora_core.apply_message(self.core.lora, self.core.scheduler, msg)
            except Exception:  # a message that cannot be applied must not end the core
                log.exception("LoRA message ignored")
            return
        if kind != ADD:
            log.warning("ignoring message of unknown type %r", kind)
            return
        try:
            req = _decode_add.decode(payload)
        except Exception as exc:  # malformed, or a field's own check raised
            self._reject(_request_id_of(payload), exc, 400)
            return
        try:
            self.pixels.resolve(req.mm_features)  # first: the sender counted on it
            self.core.add_request(req)
        except ValueError as exc:  # validated by the frontend; reject rather than crash
            self._reject(req.request_id, exc, 400, req.label)
        except Exception as exc:  # a request the core cannot take must not end the core
            log.exception("adding request %s failed", req.request_id)
            self._reject(req.request_id, exc, 500, req.label)

    def _reject(
        self, request_id: str | None, exc: Exception, status: int, label: str | None = None
    ) -> None:
        named = f"{request_id} (X-Request-Id {label!r})" if label else request_id
        log.warning("request %s rejected: %s", named, exc)
        self.rejected += 1
        if request_id is not None:  # its client waits for an answer
            out = EngineCoreOutput(request_id, [], finish_reason="abort", stop_reason=str(exc))
            out.error, out.error_status = str(exc), status
            self._send([out])

    def _event_counts(self) -> dict[str, int]:
        counts = {k: v for k, v in vars(self.publisher.stats).items() if v}
        if self.publish_failures:
            counts["publish_failures"] = self.publish_failures
        return counts

    @staticmethod
    def _counts(stats: SchedulerStats) -> tuple:
        return (
            *sorted(stats.kv_events.items()),
            stats.num_running,
            stats.num_waiting,
            stats.prefix_queries,
            stats.kv_cache_usage,
            stats.external_queries,
            stats.external_hits,
            stats.kv_load_failures,
            stats.encoder_runs,
            stats.encoder_loads,
            stats.failed_steps,
            stats.kv_save_failures,
            tuple(stats.running_loras),
            tuple(stats.waiting_loras),
        )

    def _send(self, outputs: list[EngineCoreOutput], stats: SchedulerStats | None = None) -> None:
        if stats is None:
            stats = self.core.stats()
            stats.kv_events = self._event_counts()
        self.last_counts = self._counts(stats)
        self.output.send(_encode.encode(EngineCoreOutputs(outputs, time.time(), stats)), copy=False)


def _request_id_of(payload: bytes) -> str | None:
    """The id of an add message that does not decode as a request (its first field)."""
    try:
        fields = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError:
        return None
    if isinstance(fields, list) and fields and isinstance(fields[0], str):
        return fields[0]
    return None


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM us when the frontend process dies."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="epdserve-core", description="EngineConfig on stdin")
    parser.add_argument("--input", required=True, help="frontend ROUTER address")
    parser.add_argument("--output", required=True, help="frontend PULL address")
    args = parser.parse_args(argv)
    _die_with_parent()
    setup_logging()  # the API process's --log-level/--log-format, through the environment
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    config = decode_config(sys.stdin.buffer.read())  # typed as the frontend built it
    core = EncoderCore(config) if config.role == "encoder" else EngineCore(config)
    ctx = zmq.Context()
    input_sock = ctx.socket(zmq.DEALER)
    input_sock.setsockopt(zmq.LINGER, 0)
    input_sock.connect(args.input)
    output_sock = ctx.socket(zmq.PUSH)
    output_sock.setsockopt(zmq.LINGER, 0)
    output_sock.connect(args.output)
    ready = {
        "num_blocks": core.num_blocks,
        "max_model_len": core.max_model_len,
        "block_size": config.block_size,
    }
    input_sock.send_multipart([READY, _encode.encode(ready)])
    log.info(
        "engine core ready: %d KV blocks, max_model_len %d", core.num_blocks, core.max_model_len
    )
    publisher = None
    if config.kv_events_config is not None:
        publisher = create_publisher(config.kv_events_config, curve_dir=config.kv_events_curve_dir)
    try:
        CoreLoop(core, input_sock, output_sock, publisher).run()
    finally:
        core.close()
        if publisher is not None:
            publisher.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
