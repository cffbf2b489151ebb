"""Readers of tool calls in model output: ``--tool-call-parser`` formats for
``tool_choice: "auto"``, and the grammar-forced outputs of ``"required"`` and named choices."""

from __future__ import annotations

from epdserve.engine.entrypoints.openai.tool_parsers.base import Delta, Extracted, ToolParser
from epdserve.engine.entrypoints.openai.tool_parsers.forced import NamedCall, RequiredCalls
from epdserve.engine.entrypoints.openai.tool_parsers.hermes import HermesParser
from epdserve.engine.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonParser

# --tool-call-parser NAME -> its parser
PARSERS: dict[str, type[ToolParser]] = {
    "llama3_json": Llama3JsonParser,
    "hermes": HermesParser,
}

__all__ = [
    "PARSERS",
    "Delta",
    "Extracted",
    "HermesParser",
    "Llama3JsonParser",
    "NamedCall",
    "RequiredCalls",
    "ToolParser",
]
