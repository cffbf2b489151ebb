"""Outputs a grammar forced into tool calls: ``tool_choice`` naming a function (the output is
its arguments object) and ``"required"`` (a JSON array ``[{"name": ..., "parameters":
{...}}, ...]``). No content comes out of either, as in vLLM."""

from __future__ import annotations

import json

from epdserve.engine.entrypoints.openai.tool_parsers.base import (
    Delta,
    Extracted,
    StreamedCall,
    ToolParser,
    new_call_id,
    tool_call,
)
from epdserve.engine.entrypoints.openai.tool_parsers.llama3_json import as_call


class NamedCall(ToolParser):
    """The whole output is the named function's arguments."""

    def __init__(self, name: str):
        self.name = name
        self._announced = False

    @property
    def called(self) -> bool:
        return self._announced

    def extract(self, text: str) -> Extracted:
        if not text.strip():
            return Extracted()
        return Extracted([tool_call(self.name, text)])

    def stream(self, text: str) -> Delta:
        if not text:
            return Delta()
        if self._announced:
            return Delta(tool_calls=[{"index": 0, "function": {"arguments": text}}])
        self._announced = True
        call = {
            "index": 0,
            "id": new_call_id(),
            "type": "function",
            "function": {"name": self.name, "arguments": text},
        }
        return Delta(tool_calls=[call])

    def finish(self) -> Delta:
        return Delta()


# where the array reader is
_OPEN, _ELEMENT, _CALL, _AFTER, _DONE = range(5)


class RequiredCalls(ToolParser):
    """The output is an array of calls; each is streamed as it is read."""

    def __init__(self) -> None:
        self._calls: list[StreamedCall] = []
        self._phase = _OPEN

    @property
    def called(self) -> bool:
        return any(c.announced for c in self._calls)

    def extract(self, text: str) -> Extracted:
        try:
            items = json.loads(text)
        except json.JSONDecodeError:
            return Extracted()
        calls = [as_call(item) for item in items] if isinstance(items, list) else [None]
        return Extracted(calls) if None not in calls else Extracted()

    def stream(self, text: str) -> Delta:
        out, pos = Delta(), 0
        while pos < len(text) and self._phase != _DONE:
            if self._phase == _CALL:
                call = self._calls[-1]
                pos += call.scanner.feed(text[pos:])
                out.tool_calls += call.deltas()
                if call.scanner.bad:
                    self._phase = _DONE
                elif call.scanner.closed:
                    self._phase = _AFTER
                continue
            ch = text[pos]
            pos += 1
            if ch.isspace():
                continue
            self._phase = self._next(ch)
        return out

    def _next(self, ch: str) -> int:
        """The phase after a character outside the calls."""
        if self._phase == _OPEN:
            return _ELEMENT if ch == "[" else _DONE
        if ch == "{" and self._phase == _ELEMENT:
            self._calls.append(StreamedCall(len(self._calls)))
            self._calls[-1].scanner.feed(ch)
            return _CALL
        if ch == "," and self._phase == _AFTER:
            return _ELEMENT
        return _DONE  # "]", or anything else

    def finish(self) -> Delta:
        return Delta()
