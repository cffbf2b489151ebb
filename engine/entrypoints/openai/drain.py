"""Graceful scale-down of one engine pod: SIGTERM drains, then the engine core stops.

On SIGTERM (or SIGINT) the pod leaves rotation at once (``/ready`` says 503, a generation
request that still reaches it gets 503 "draining", which the router retries on another pod)
and uvicorn closes its listening socket. Requests and streams in flight run to the end, for
at most ``drain_timeout`` seconds; only then does the lifespan shutdown stop the engine core,
so the core outlives the last stream. A drained exit is a clean exit (status 0).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading

import uvicorn

log = logging.getLogger("epdserve.server")

DRAIN_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class DrainingServer(uvicorn.Server):
    """uvicorn's server with the first exit signal turned into a drain of ``state``."""

    def __init__(self, config: uvicorn.Config, state) -> None:
        super().__init__(config)
        self.state = state  # api_server.ServerState

    def handle_exit(self, sig: int, frame) -> None:
        if not self.state.draining:
            self.state.draining = True
            log.info(
                "draining: %s; %d request(s) in flight, up to %ss to finish",
                signal.Signals(sig).name,
                self.state.engine.num_in_flight,
                self.config.timeout_graceful_shutdown,
            )
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
        # As uvicorn's, minus re-raising the signal after shutdown: that would end a fully
        # drained process with "killed by SIGTERM" instead of status 0.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in DRAIN_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def serve(app, state, *, host: str, port: int, log_level: str, access_log: bool, drain_timeout):
    """Run ``app`` until a signal, then drain for at most ``drain_timeout`` seconds."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        log_config=None,  # uvicorn's loggers go through ours (same format)
        access_log=access_log,
        timeout_graceful_shutdown=drain_timeout,
        **state.http.uvicorn_options(),  # concurrency limit, keep-alive, header deadline
    )
    server = DrainingServer(config, state)
    server.run()
    if not server.started:  # the lifespan (engine start) failed
        raise SystemExit(3)
    log.info("drained: shut down")
