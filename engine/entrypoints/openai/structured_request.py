"""The request fields that constrain the output, mapped onto ``StructuredOutputsParams``.

Sources, at most one per request (a 400 names the second): ``response_format``
(``json_object``, ``json_schema``, ``structural_tag``), vLLM's ``structured_outputs`` object,
the older ``guided_*`` names, and a chat's ``tool_choice`` of ``required`` or a named
function. Every failure is ``APIError(400)`` naming the field as the client wrote it.
"""

from __future__ import annotations

import re
from typing import Any

from epdserve.engine.entrypoints.openai.errors import APIError
from epdserve.engine.entrypoints.openai.tool_request import ToolRequest
from epdserve.engine.structured import backend
from epdserve.engine.structured.params import KINDS, StructuredOutputsParams

GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
BACKENDS = (None, "auto", "xgrammar")  # guided_decoding_backend values this server honours
# vLLM's options beside the kind: what each may be here (None: any value of that type)
OPTIONS: dict[str, tuple[type, tuple | None]] = {
    "disable_any_whitespace": (bool, None),
    # xgrammar runs in strict mode: properties outside the schema are never generated
    "disable_additional_properties": (bool, None),
    "disable_fallback": (bool, None),  # there is one backend: nothing to fall back to
    "whitespace_pattern": (str, ()),  # not honoured: only null is accepted
}
_PARAMS_PREFIX = re.compile(r"^structured_outputs(\.\w+)?:\s*")


class Constraint:
    """One source's constraint: the params and the field a 400 names."""

    def __init__(self, field: str, kind: str, value: Any):
        self.field, self.kind, self.value = field, kind, value


def structured_outputs_of(req, forced_tool_schema: dict | None = None):
    """``StructuredOutputsParams`` for the request, or None; raises ``APIError(400)``.
    Runs the backend's check (a grammar build): call it off the event loop."""
    found = _constraints(req, forced_tool_schema)
    options = _options(getattr(req, "structured_outputs", None))
    if not found:
        if getattr(req, "structured_outputs", None) is not None:
            raise APIError(
                400,
                f"structured_outputs: exactly one of {', '.join(KINDS)} must be given",
                "structured_outputs",
            )
        return None
    if len(found) > 1:
        first, second = found[0], found[1]
        raise APIError(
            400,
            f"{second.field}: only one structured output constraint per request, and "
            f"{first.field} already gives one",
            second.field,
        )
    return _build(found[0], options)


def check_tool_parameters(tools: ToolRequest) -> None:
    """Each forced tool's parameter schema builds a grammar, or a 400 names that tool."""
    for i, tool in enumerate(tools.tools or ()):
        if isinstance(tools.tool_choice, dict) and (
            tool["function"]["name"] != tools.tool_choice["function"]["name"]
        ):
            continue
        schema = tool["function"].get("parameters")
        if schema is not None:
            _build(Constraint(f"tools[{i}].function.parameters", "json", schema), {})


def wants_structured_outputs(req) -> bool:
    """Whether any field constrains the output (most requests: no thread hop)."""
    fields = ("response_format", "structured_outputs", *GUIDED, "guided_decoding_backend")
    fields += ("guided_whitespace_pattern",)
    return any(getattr(req, name, None) is not None for name in fields)


def _build(one: Constraint, options: dict) -> StructuredOutputsParams:
    try:
        params = StructuredOutputsParams(**{one.kind: one.value}, **options)
    except ValueError as exc:
        raise _named(one.field, exc) from None
    try:  # the schema keyword check, then the grammar build
        backend.validate(params, field=one.field)
    except ValueError as exc:
        raise APIError(400, str(exc), one.field) from None
    return params


def _named(field: str, exc: ValueError) -> APIError:
    return APIError(400, f"{field}: {_PARAMS_PREFIX.sub('', str(exc))}", field)


def _constraints(req, forced_tool_schema: dict | None) -> list[Constraint]:
    found: list[Constraint] = []
    response_format = getattr(req, "response_format", None)
    if response_format is not None:
        found += _from_response_format(response_format)
    structured = getattr(req, "structured_outputs", None)
    if structured is not None:
        found += _from_structured_outputs(structured)
    for name, kind in GUIDED.items():
        value = getattr(req, name, None)
        if value is not None:
            found.append(Constraint(name, kind, value))
    backend_name = getattr(req, "guided_decoding_backend", None)
    if backend_name not in BACKENDS:
        raise APIError(
            400,
            f"guided_decoding_backend: this server uses xgrammar, got {backend_name!r}",
            "guided_decoding_backend",
        )
    if getattr(req, "guided_whitespace_pattern", None) is not None:
        raise APIError(
            400,
            "guided_whitespace_pattern: not supported (use disable_any_whitespace)",
            "guided_whitespace_pattern",
        )
    if forced_tool_schema is not None:
        found.append(Constraint("tool_choice", "json", forced_tool_schema))
    return found


def _from_response_format(fmt: dict) -> list[Constraint]:
    kind = fmt.get("type")
    if kind == "text":
        _only_keys(fmt, ("type",), "response_format")
        return []
    if kind == "json_object":
        _only_keys(fmt, ("type",), "response_format")
        return [Constraint("response_format", "json_object", True)]
    if kind == "json_schema":
        _only_keys(fmt, ("type", "json_schema"), "response_format")
        return [_json_schema(fmt.get("json_schema"))]
    if kind == "structural_tag":
        tag = structural_tag(fmt, "response_format")
        return [Constraint("response_format", "structural_tag", tag)]
    raise APIError(
        400,
        "response_format.type: must be one of 'text', 'json_object', 'json_schema', "
        f"'structural_tag', got {kind!r}",
        "response_format.type",
    )


def _json_schema(spec: Any) -> Constraint:
    where = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise APIError(
            400,
            "response_format: when its type is 'json_schema', the 'json_schema' field must "
            "be provided",
            "response_format",
        )
    _only_keys(spec, ("name", "schema", "strict", "description"), where)
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise APIError(400, f"{where}.name: must be a non-empty string", f"{where}.name")
    for key, kind in (("strict", bool), ("description", str)):
        if spec.get(key) is not None and not isinstance(spec[key], kind):
            raise APIError(400, f"{where}.{key}: must be a {kind.__name__}", f"{where}.{key}")
    if spec.get("schema") is None:
        raise APIError(400, f"{where}.schema: a JSON schema is required", f"{where}.schema")
    return Constraint(f"{where}.schema", "json", spec["schema"])


def structural_tag(fmt: dict, where: str) -> dict:
    """xgrammar's structural tag; vLLM's older shape (``structures`` + ``triggers``) is
    rewritten into the ``triggered_tags`` format it stands for."""
    if "structures" not in fmt:
        return fmt
    structures, triggers = fmt.get("structures"), fmt.get("triggers")
    if not isinstance(structures, list) or not all(isinstance(s, dict) for s in structures):
        raise APIError(400, f"{where}.structures: must be a list of objects", where)
    tags = [
        {
            "begin": s.get("begin"),
            "content": {"type": "json_schema", "json_schema": s.get("schema", {})},
            "end": s.get("end"),
        }
        for s in structures
    ]
    return {
        "type": "structural_tag",
        "format": {"type": "triggered_tags", "triggers": triggers, "tags": tags},
    }


def _from_structured_outputs(spec: dict) -> list[Constraint]:
    _only_keys(spec, (*KINDS, *OPTIONS), "structured_outputs")
    found = []
    for kind in KINDS:
        value = spec.get(kind)
        if value is None or (kind == "json_object" and value is False):
            continue
        if kind == "structural_tag" and isinstance(value, dict):
            value = structural_tag(value, "structured_outputs.structural_tag")
        found.append(Constraint(f"structured_outputs.{kind}", kind, value))
    return found


def _options(spec: dict | None) -> dict:
    """The options the params take (``disable_any_whitespace``); others checked, dropped."""
    options = {}
    for key, (kind, allowed) in OPTIONS.items():
        value = (spec or {}).get(key)
        if value is None:
            continue
        field = f"structured_outputs.{key}"
        if not isinstance(value, kind):
            raise APIError(400, f"{field}: must be a {kind.__name__}", field)
        if allowed is not None and value not in allowed:
            raise APIError(400, f"{field}: not supported by this server (got {value!r})", field)
        if key == "disable_any_whitespace":
            options[key] = value
    return options


def _only_keys(obj: dict, allowed: tuple[str, ...], where: str) -> None:
    """An unknown key is refused: an ignored control would change the output unseen."""
    for key in obj:
        if key not in allowed:
            raise APIError(400, f"{where}.{key}: unrecognized field", f"{where}.{key}")
