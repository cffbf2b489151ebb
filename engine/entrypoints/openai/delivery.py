"""How a prepared request's answer reaches its client: the admission it holds is given back
when the response ends (however it ends), a stream that fails after its first byte ends
with an error event, and a non-streamed request is cancelled when its client leaves."""

from __future__ import annotations

import asyncio
import logging

from fastapi import Request
from fastapi.responses import StreamingResponse

from epdserve.engine.async_llm import EngineDeadError, RequestFailedError
from epdserve.engine.entrypoints.openai.errors import APIError, error_body
from epdserve.engine.entrypoints.openai.serving import sse

log = logging.getLogger("epdserve.server")


class Once:
    """``fn(*args)`` on the first call only."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __call__(self) -> None:
        fn, self.fn = self.fn, None
        if fn is not None:
            fn(*self.args)


class AdmittedStream(StreamingResponse):
    """A stream that gives its admission back when it ends, however it ends (the server
    always runs the response it was handed, even for a client already gone)."""

    def __init__(self, content, release: Once, **kwargs):
        super().__init__(content, **kwargs)
        self.release = release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.release()


async def guard_stream(body):
    """Errors after the first byte cannot change the status: end the stream with an error event."""
    try:
        async for chunk in body:
            yield chunk
    except EngineDeadError as exc:
        yield sse(error_body(503, f"engine unavailable: {exc}"))
        yield b"data: [DONE]\n\n"
    except RequestFailedError as exc:
        yield sse(error_body(exc.status, str(exc)))
        yield b"data: [DONE]\n\n"
    except APIError as exc:
        yield sse(error_body(exc.status, exc.message, exc.param))
        yield b"data: [DONE]\n\n"
    except Exception as exc:  # the stream ends with an error event, never a cut connection
        log.exception("stream failed")
        yield sse(error_body(500, f"internal error ({type(exc).__name__})"))
        yield b"data: [DONE]\n\n"


async def until_disconnect(raw: Request, work):
    """Run a non-streaming request, cancelling it (and aborting in the core) on disconnect."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                return task.result()
            if await raw.is_disconnected():
                task.cancel()
                raise APIError(499, "client disconnected")
    finally:
        if not task.done():
            task.cancel()
