"""``StructuredOutputsParams``: what one request's output must match (vLLM's field).

Exactly one kind per request: a JSON schema (``json``), any JSON object (``json_object``), a
regular expression, a choice among strings, an EBNF grammar or an xgrammar structural tag.
It travels inside ``SamplingParams`` (msgpack) to the engine core, which compiles it once
per distinct ``key()`` and masks each step's logits with it.
"""

from __future__ import annotations

import json as _json
from typing import Any

import msgspec

MAX_SPEC_BYTES = 64 << 10  # a schema, regex, grammar or tag: bounds its compile time
MAX_CHOICES = 1024
KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Invalid shapes raise ``ValueError`` naming ``structured_outputs.<field>``. Whether a
    schema, regex or grammar is well formed is the grammar backend's check
    (``engine/structured/backend.py: validate``)."""

    json: Any = None  # a JSON schema: a dict, or its JSON text
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (GBNF style, as vLLM/xgrammar take it)
    structural_tag: Any = None  # xgrammar's structural tag: a dict, or its JSON text
    disable_any_whitespace: bool = False  # JSON: no free whitespace between tokens

    def __post_init__(self) -> None:
        if isinstance(self.json, str):
            self.json = _parse_json(self.json, "json")
        if isinstance(self.structural_tag, str):
            self.structural_tag = _parse_json(self.structural_tag, "structural_tag")
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs: exactly one of "
                f"{', '.join(KINDS)} must be given, got {', '.join(given) or 'none'}"
            )
        _check_shapes(self)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def spec_text(self) -> str:
        """The spec as text. JSON keys keep their order: a schema's property order is the
        order the output's properties come in."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json_object":
            return ""
        if kind in ("json", "structural_tag", "choice"):
            return _json.dumps(value, separators=(",", ":"), ensure_ascii=False)
        return value

    def key(self) -> tuple[str, str, bool]:
        """What one compiled grammar serves: requests with an equal key share it."""
        return self.kind, self.spec_text(), self.disable_any_whitespace


def _parse_json(text: str, field: str) -> Any:
    if len(text.encode()) > MAX_SPEC_BYTES:
        raise ValueError(f"structured_outputs.{field}: at most {MAX_SPEC_BYTES} bytes")
    try:
        return _json.loads(text)
    except ValueError as exc:
        raise ValueError(f"structured_outputs.{field}: not valid JSON ({exc})") from None


def _check_shapes(p: StructuredOutputsParams) -> None:
    kind = p.kind
    field = f"structured_outputs.{kind}"
    if kind == "json" and not isinstance(p.json, (dict, bool)):
        raise ValueError(f"{field}: a JSON schema is an object (or true/false)")
    if kind == "structural_tag" and not isinstance(p.structural_tag, dict):
        raise ValueError(f"{field}: must be an object")
    if kind in ("regex", "grammar"):
        value = getattr(p, kind)
        if not isinstance(value, str) or not value:
            raise ValueError(f"{field}: must be a non-empty string")
    if kind == "choice":
        choices = p.choice
        if not isinstance(choices, list) or not choices:
            raise ValueError(f"{field}: must be a non-empty list of strings")
        if len(choices) > MAX_CHOICES:
            raise ValueError(f"{field}: at most {MAX_CHOICES} choices")
        if not all(isinstance(c, str) and c for c in choices):
            raise ValueError(f"{field}: every choice must be a non-empty string")
    if kind != "json_object" and len(p.spec_text().encode()) > MAX_SPEC_BYTES:
        raise ValueError(f"{field}: at most {MAX_SPEC_BYTES} bytes")
