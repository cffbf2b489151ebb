"""Llama 3's JSON tool calls: the output is ``{"name": ..., "parameters": {...}}`` (or
``"arguments"``), possibly several separated by ``;``, optionally after ``<|python_tag|>``.

Calls must open the output (after whitespace): text that starts otherwise is content, in a
stream as in a whole output, so both read the same text the same way. Text after the last
call is content; a malformed call leaves the whole output as content.
"""

from __future__ import annotations

import json

from epdserve.engine.entrypoints.openai.tool_parsers.base import (
    Delta,
    Extracted,
    StreamedCall,
    ToolParser,
    tool_call,
)

PYTHON_TAG = "<|python_tag|>"
_SEPARATORS = " \t\r\n;"

# stream phases
_START, _CALL, _BETWEEN, _CONTENT, _BAD = range(5)


def as_call(obj) -> dict | None:
    """A ``tool_call`` from a decoded object, or None when it is not a call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if "arguments" in obj:
        args = obj["arguments"]
    elif "parameters" in obj:
        args = obj["parameters"]
    else:
        return None
    return tool_call(obj["name"], json.dumps(args, ensure_ascii=False))


def _opening(text: str) -> int | None:
    """Where the first call's ``{`` is, -1 when the output is not calls, None while the
    start is still undecided (whitespace, part of the tag)."""
    body = text.lstrip()
    if PYTHON_TAG.startswith(body) and len(body) < len(PYTHON_TAG):
        return None
    offset = len(text) - len(body)
    if body.startswith(PYTHON_TAG):
        after = body[len(PYTHON_TAG) :]
        offset += len(PYTHON_TAG) + len(after) - len(after.lstrip())
        body = after.lstrip()
        if not body:
            return None
    return offset if body[0] == "{" else -1


class Llama3JsonParser(ToolParser):
    def __init__(self) -> None:
        self._text = ""
        self._pos = 0  # where reading resumes
        self._phase = _START
        self._calls: list[StreamedCall] = []
        self._call_start = 0  # where the last call's text began

    @property
    def called(self) -> bool:
        return any(c.announced for c in self._calls)

    def extract(self, text: str) -> Extracted:
        start = _opening(text)
        if start is None or start < 0:
            return Extracted(content=text)
        decoder, calls, pos = json.JSONDecoder(), [], start
        while pos < len(text) and text[pos] == "{":
            try:
                obj, pos = decoder.raw_decode(text, pos)
            except json.JSONDecodeError:
                return Extracted(content=text)
            call = as_call(obj)
            if call is None:
                return Extracted(content=text)
            calls.append(call)
            while pos < len(text) and text[pos] in _SEPARATORS:
                pos += 1
        return Extracted(calls, text[pos:] or None)

    def stream(self, text: str) -> Delta:
        self._text += text
        out = Delta()
        while self._pos < len(self._text) and self._phase != _BAD:
            if self._phase == _START:
                start = _opening(self._text)
                if start is None:
                    break
                if start < 0:
                    self._phase = _CONTENT
                    continue
                self._begin_call(start)
            elif self._phase == _CALL:
                self._read_call(out)
            elif self._phase == _BETWEEN:
                ch = self._text[self._pos]
                if ch in _SEPARATORS:
                    self._pos += 1
                elif ch == "{":
                    self._begin_call(self._pos)
                else:
                    self._phase = _CONTENT
            else:  # content: the rest of the output
                out.content += self._text[self._pos :]
                self._pos = len(self._text)
        return out

    def _begin_call(self, pos: int) -> None:
        self._phase, self._pos, self._call_start = _CALL, pos, pos
        self._calls.append(StreamedCall(len(self._calls)))

    def _read_call(self, out: Delta) -> None:
        call = self._calls[-1]
        self._pos += call.scanner.feed(self._text[self._pos :])
        out.tool_calls += call.deltas()
        if call.scanner.bad or call.scanner.closed and not call.announced:
            self._phase = _BAD
        elif call.scanner.closed:
            self._phase = _BETWEEN

    def finish(self) -> Delta:
        if not self.called:  # nothing became a call: the whole output is content
            return Delta(content="" if self._phase == _CONTENT else self._text)
        if self._phase in (_CALL, _BAD) and not self._calls[-1].announced:
            return Delta(content=self._text[self._call_start :])
        return Delta()
