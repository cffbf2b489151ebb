"""``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat request, checked as vLLM
does, and the JSON schema that enforces ``required`` or a named function as structured
outputs (the output side turns the forced JSON back into ``tool_calls``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from epdserve.engine.entrypoints.openai.errors import APIError

MAX_TOOLS = 128  # OpenAI's bound on functions per request
_USAGE = 'Correct usage: {"type": "function", "function": {"name": "my_function"}}'


@dataclass(frozen=True)
class ToolRequest:
    """What the output side needs: the tools as given (plain dicts), the choice in force
    (``"auto"`` when tools come without one), and whether several calls may be made."""

    tools: list[dict] | None
    tool_choice: str | dict | None
    parallel_tool_calls: bool

    @property
    def forced(self) -> bool:
        """``required`` or a named function: the output is a call, enforced by a schema."""
        return self.tools is not None and self.tool_choice not in ("none", "auto")


def check_tools(tools: list[dict] | None, tool_choice: Any, parallel: bool | None) -> ToolRequest:
    """The request's tool fields, or ``APIError(400)`` naming the field at fault. (Whether
    the server may serve ``auto`` is the output side's check: it needs a tool parser.)"""
    if tools is not None:
        _check_tool_list(tools)
    if tools is None:
        if tool_choice not in (None, "none"):
            raise APIError(
                400, "tool_choice: when using `tool_choice`, `tools` must be set", "tool_choice"
            )
        return ToolRequest(None, tool_choice, parallel is not False)
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        _check_named(choice, tools)
    elif choice not in ("none", "auto", "required"):
        raise APIError(
            400,
            f"tool_choice: invalid value {choice!r}; only named tools, "
            '"none", "auto" or "required" are supported',
            "tool_choice",
        )
    return ToolRequest(tools, choice, parallel is not False)


def _check_tool_list(tools: list) -> None:
    if not tools:
        raise APIError(
            400,
            "tools: must not be an empty array; give at least one tool or omit the field",
            "tools",
        )
    if len(tools) > MAX_TOOLS:
        raise APIError(400, f"tools: at most {MAX_TOOLS} tools, got {len(tools)}", "tools")
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise APIError(400, f"{where}: must be an object", where)
        if tool.get("type", "function") != "function":
            raise APIError(
                400, f"{where}.type: only 'function' tools are supported", f"{where}.type"
            )
        function = tool.get("function")
        if not isinstance(function, dict):
            raise APIError(400, f"{where}.function: must be an object", f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise APIError(
                400, f"{where}.function.name: must be a non-empty string", f"{where}.function.name"
            )
        if name in seen:
            raise APIError(
                400,
                f"{where}.function.name: duplicate tool name {name!r}",
                f"{where}.function.name",
            )
        seen.add(name)
        for key, kind in (("description", str), ("parameters", dict), ("strict", bool)):
            value = function.get(key)
            if value is not None and not isinstance(value, kind):
                field = f"{where}.function.{key}"
                raise APIError(400, f"{field}: must be {_A[kind]}", field)


_A = {str: "a string", dict: "a JSON schema object", bool: "a boolean"}


def _check_named(choice: dict, tools: list[dict]) -> None:
    if choice.get("type", "function") != "function":
        raise APIError(
            400, f"tool_choice.type: only 'function' is supported. {_USAGE}", "tool_choice.type"
        )
    function = choice.get("function")
    if not isinstance(function, dict):
        raise APIError(
            400,
            f"tool_choice.function: invalid value {function!r}. {_USAGE}",
            "tool_choice.function",
        )
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise APIError(
            400,
            f"tool_choice.function.name: must be a non-empty string. {_USAGE}",
            "tool_choice.function.name",
        )
    if name not in (t["function"]["name"] for t in tools):
        raise APIError(
            400,
            f"tool_choice: the tool {name!r} does not match any of the specified `tools`",
            "tool_choice",
        )


def _parameters(tool: dict) -> dict:
    """A tool's parameter schema; none still makes the arguments a JSON object."""
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def forced_schema(req: ToolRequest) -> dict:
    """The JSON schema of the forced output: the named function's arguments, or for
    ``required`` an array of ``{"name", "parameters"}`` calls (one of each tool's shape;
    at most one call without ``parallel_tool_calls``). Each tool's ``$defs`` move to the
    root, where its ``#/$defs/...`` references then point."""
    assert req.forced, "only required or named choices are forced"
    if isinstance(req.tool_choice, dict):
        name = req.tool_choice["function"]["name"]
        return _parameters(next(t for t in req.tools if t["function"]["name"] == name))
    defs: dict[str, dict[str, Any]] = {"$defs": {}, "definitions": {}}
    branches = []
    for i, tool in enumerate(req.tools):
        params = dict(_parameters(tool))
        field = f"tools[{i}].function.parameters"
        for key, found in defs.items():
            given = params.pop(key, None) or {}
            if not isinstance(given, dict):
                raise APIError(400, f"{field}.{key}: must be an object", f"{field}.{key}")
            for def_name, def_schema in given.items():
                if found.get(def_name, def_schema) != def_schema:
                    raise APIError(
                        400, f"{field}: {key} '{def_name}' differs from another tool's", field
                    )
                found[def_name] = def_schema
        name = tool["function"]["name"]
        branches.append(
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
    if not req.parallel_tool_calls:
        schema["maxItems"] = 1
    schema.update({key: found for key, found in defs.items() if found})
    return schema
