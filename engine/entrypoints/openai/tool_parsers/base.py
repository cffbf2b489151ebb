"""What every tool-call parser gives: calls from a whole text, or OpenAI-shaped deltas from a
stream (the first delta of a call carries its index, id, type and name; later ones carry
pieces of its arguments text, which put together are the arguments' JSON)."""

from __future__ import annotations

import abc
import uuid
from dataclasses import dataclass, field

from epdserve.engine.entrypoints.openai.tool_parsers.scanner import CallScanner


def new_call_id() -> str:
    """``chatcmpl-tool-<32 hex>``, as vLLM names a tool call."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def tool_call(name: str, arguments: str) -> dict:
    """One entry of a message's ``tool_calls``."""
    return {
        "id": new_call_id(),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


@dataclass
class Extracted:
    """A whole output read by a parser: its calls (``tool_call`` dicts) and the text the
    answer keeps as ``content`` (None when there is none)."""

    calls: list[dict] = field(default_factory=list)
    content: str | None = None


@dataclass
class Delta:
    """What one stream step adds: content text and/or tool-call delta entries."""

    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)

    def add(self, other: Delta) -> Delta:
        self.content += other.content
        self.tool_calls += other.tool_calls
        return self


class StreamedCall:
    """One call of a stream: announced when its scanner is ready, then its arguments' text
    is passed on as it grows."""

    def __init__(self, index: int, scanner: CallScanner | None = None):
        self.index = index
        self.scanner = scanner or CallScanner()
        self.announced = False
        self._sent = 0  # characters of the arguments text passed on

    def deltas(self) -> list[dict]:
        scanner = self.scanner
        if not self.announced and not scanner.ready:
            return []
        args = scanner.arguments_text()
        piece, self._sent = args[self._sent :], len(args)
        if not self.announced:
            self.announced = True
            return [
                {
                    "index": self.index,
                    "id": new_call_id(),
                    "type": "function",
                    "function": {"name": scanner.name, "arguments": piece},
                }
            ]
        return [{"index": self.index, "function": {"arguments": piece}}] if piece else []


class ToolParser(abc.ABC):
    """One choice's reader of a model's tool-call format (stateful when streaming: one per
    choice and request)."""

    # the format's markers may be special tokens: the text must keep them
    needs_special_tokens = False

    @abc.abstractmethod
    def extract(self, text: str) -> Extracted:
        """The calls in a whole output; a malformed one leaves the whole text as content."""

    @abc.abstractmethod
    def stream(self, text: str) -> Delta:
        """The next piece of output: content to pass on now and tool-call deltas. Text that
        may still turn out to be a call is held back."""

    @abc.abstractmethod
    def finish(self) -> Delta:
        """The end of the output: text held back that never became a call, as content."""

    @property
    @abc.abstractmethod
    def called(self) -> bool:
        """Whether a call has been announced in the stream."""
