"""Structured outputs: JSON schemas, regexes, choices and grammars enforced while decoding."""

from epdserve.engine.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
