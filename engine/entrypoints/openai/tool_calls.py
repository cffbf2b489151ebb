"""Tool calls in chat answers, as vLLM gives them.

``tool_choice`` "auto" reads calls out of the text with the ``--tool-call-parser`` format
(only with ``--enable-auto-tool-choice``: else a 400); "required" and a named function read
the JSON their grammar forced. A message with calls has ``tool_calls``; its finish_reason is
"tool_calls" for "auto" and "required", and the engine's own for a named function (as
OpenAI). ``parallel_tool_calls: false`` keeps the first call only.
"""

from __future__ import annotations

from dataclasses import dataclass

from epdserve.engine.entrypoints.openai.errors import APIError
from epdserve.engine.entrypoints.openai.tool_parsers import (
    PARSERS,
    NamedCall,
    RequiredCalls,
    ToolParser,
)

AUTO_NEEDS_FLAGS = (
    'tool_choice: "auto" tool choice requires --enable-auto-tool-choice and '
    "--tool-call-parser to be set"
)


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # "auto" | "required" | "named"
    name: str | None = None  # the named function
    parallel: bool = True


def tool_choice(prep) -> ToolChoice | None:
    """How the request's answer may call tools; None: its text is plain content."""
    choice = prep.tool_choice
    if prep.kind != "chat" or not prep.tools or choice == "none":
        return None
    parallel = prep.parallel_tool_calls
    if isinstance(choice, dict):
        return ToolChoice("named", choice["function"]["name"], parallel)
    return ToolChoice("required" if choice == "required" else "auto", None, parallel)


def check_tool_choice(serving, prep) -> None:
    """Before the request runs: "auto" needs a parser; one whose tags may be special tokens
    needs them kept in the text (vLLM does the same)."""
    choice = tool_choice(prep)
    if choice is None or choice.mode != "auto":
        return
    name = getattr(serving, "tool_parser_name", None)
    if name is None:
        raise APIError(400, AUTO_NEEDS_FLAGS, "tool_choice")
    if PARSERS[name].needs_special_tokens:
        prep.params.skip_special_tokens = False


class ChoiceTools:
    """One choice's tool calls (parsers keep stream state: one per choice)."""

    def __init__(self, choice: ToolChoice, parser: ToolParser):
        self.choice, self.parser = choice, parser
        self.streamed = False  # a tool-call delta went out

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """A whole output's ``message`` fields (content, tool_calls) and finish_reason."""
        found = self.parser.extract(text)
        calls = found.calls if self.choice.parallel else found.calls[:1]
        if self.choice.mode != "auto":
            fields = {"content": ""}
            if self.choice.mode == "required" and finish_reason == "stop":
                finish_reason = "tool_calls"
        elif calls:
            content = found.content
            fields = {"content": content if content and content.strip() else None}
            finish_reason = "tool_calls"
        else:
            fields = {"content": text}
        if calls:
            fields["tool_calls"] = calls
        return fields, finish_reason

    def delta(self, text: str, finished: bool, prefix: str = "") -> dict | None:
        """A stream step's ``delta`` (None: nothing to send yet); ``prefix`` (the echo)
        leads its content."""
        step = self.parser.stream(text)
        if finished:
            step.add(self.parser.finish())
        delta: dict = {}
        if prefix or step.content:
            delta["content"] = prefix + step.content
        calls = step.tool_calls
        if not self.choice.parallel:
            calls = [c for c in calls if c["index"] == 0]
        if calls:
            delta["tool_calls"] = calls
            self.streamed = True
        return delta or None

    def finish_reason(self, reason: str | None) -> str | None:
        """A stream's finish_reason: "tool_calls" once calls went out, unless named."""
        if self.streamed and self.choice.mode != "named" and reason == "stop":
            return "tool_calls"
        return reason


def choice_tools(serving, prep, num_choices: int) -> list[ChoiceTools] | None:
    """One ``ChoiceTools`` per choice, or None when the answer is plain text."""
    choice = tool_choice(prep)
    if choice is None:
        return None
    out = []
    for _ in range(num_choices):
        if choice.mode == "named":
            parser: ToolParser = NamedCall(choice.name)
        elif choice.mode == "required":
            parser = RequiredCalls()
        else:
            parser = PARSERS[serving.tool_parser_name]()
        out.append(ChoiceTools(choice, parser))
    return out
