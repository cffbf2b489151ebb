"""Hermes/Qwen tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks.

Text before the first block is content; text between and after blocks is not (vLLM's rule).
The last block may lack its closing tag (the output ended). A block is read as one JSON object
(a ``</tool_call>`` inside a string stays in the string); a malformed one leaves the whole
output as content.
"""

from __future__ import annotations

import json

from epdserve.engine.entrypoints.openai.tool_parsers.base import (
    Delta,
    Extracted,
    StreamedCall,
    ToolParser,
)
from epdserve.engine.entrypoints.openai.tool_parsers.llama3_json import as_call
from epdserve.engine.entrypoints.openai.tool_parsers.scanner import CallScanner

OPEN, CLOSE = "<tool_call>", "</tool_call>"

# stream phases
_CONTENT, _BLOCK, _CALL, _OUTSIDE = range(4)


def _tag_prefix_len(text: str, tag: str) -> int:
    """How many of ``text``'s last characters could begin ``tag`` (held back)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class HermesParser(ToolParser):
    needs_special_tokens = True  # the tags are special tokens in some vocabularies

    def __init__(self) -> None:
        self._text = ""
        self._pos = 0  # where reading resumes
        self._sent = 0  # content passed on so far (the text before the first block)
        self._phase = _CONTENT
        self._calls: list[StreamedCall] = []

    @property
    def called(self) -> bool:
        return any(c.announced for c in self._calls)

    def extract(self, text: str) -> Extracted:
        first = text.find(OPEN)
        if first < 0:
            return Extracted(content=text)
        calls, pos = [], first
        while pos >= 0:  # each block: whitespace, then one call object
            body = text[pos + len(OPEN) :]
            scanner = CallScanner()
            used = scanner.feed(body.lstrip())
            if not (scanner.closed and scanner.ready):
                return Extracted(content=text)
            calls.append(as_call(json.loads(scanner.text)))
            pos = text.find(OPEN, len(text) - len(body.lstrip()) + used)
        return Extracted(calls, text[:first] or None)

    def stream(self, text: str) -> Delta:
        self._text += text
        out = Delta()
        while self._pos < len(self._text):
            if self._phase == _CONTENT:
                if not self._read_content(out):
                    break
            elif self._phase == _BLOCK:  # whitespace, then the call's "{"
                ch = self._text[self._pos]
                if ch.isspace():
                    self._pos += 1
                    continue
                self._phase = _CALL
                self._calls.append(StreamedCall(len(self._calls)))
            elif self._phase == _CALL:
                call = self._calls[-1]
                self._pos += call.scanner.feed(self._text[self._pos :])
                out.tool_calls += call.deltas()
                if call.scanner.done:
                    self._phase = _OUTSIDE
                    if not call.announced:  # not a call: skipped, its index reused
                        self._calls.pop()
            else:  # between blocks: only the next block's tag counts
                found = self._text.find(OPEN, self._pos)
                if found < 0:
                    self._pos = len(self._text) - _tag_prefix_len(self._text, OPEN)
                    break
                self._phase, self._pos = _BLOCK, found + len(OPEN)
        return out

    def _read_content(self, out: Delta) -> bool:
        """Pass on the content before the first block; True once the block has begun."""
        found = self._text.find(OPEN, self._pos)
        if found < 0:
            end = len(self._text) - _tag_prefix_len(self._text, OPEN)
            out.content += self._text[self._sent : end]
            self._sent = self._pos = end
            return False
        out.content += self._text[self._sent : found]
        self._sent = found
        self._phase, self._pos = _BLOCK, found + len(OPEN)
        return True

    def finish(self) -> Delta:
        if not self.called:  # no block became a call: the rest is content
            return Delta(content=self._text[self._sent :])
        return Delta()
