"""The one chat-template renderer: a model directory's jinja template, rendered with the
semantics of transformers' ``apply_chat_template`` (no torch, no transformers).

The engine renders every chat prompt with it, and the router renders text-only prompts with
it to route by prefix; tests hold it equal to transformers on every template we ship.
What transformers does and this module does too: a sandboxed environment with
``trim_blocks``/``lstrip_blocks`` and loop controls, the ``{% generation %}`` tag, its
``tojson`` (no HTML escaping), ``raise_exception``, ``strftime_now``, ``dict`` and an
underscore-refusing ``namespace``; the tokenizer's named special tokens as variables
(``bos_token``, ..., and model-specific ones such as ``boi_token``); messages with ``None``
fields dropped and reasoning aliased; ``tools``, ``documents``, ``continue_final_message``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import jinja2

from epdserve.common.template_env import template_environment

# apply_chat_template's own arguments (and the template's ``messages``): a client must not
# reach them through ``chat_template_kwargs``
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "sanitize_control_tokens",
        "tokenizer_kwargs",
        "chat_template",
        "add_generation_prompt",
    }
)
NAMED_SPECIALS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token")
NAMED_SPECIALS += ("cls_token", "mask_token")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(ValueError):
    """A request the template cannot render; the message starts with the field at fault."""


class ChatTemplate:
    """A model's chat template(s) and special tokens; ``render`` is thread-safe."""

    def __init__(self, templates: str | Mapping[str, str], specials: Mapping[str, str]) -> None:
        self.templates = {"default": templates} if isinstance(templates, str) else dict(templates)
        self.specials = dict(specials)
        self._compiled: dict[str, jinja2.Template] = {}

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ChatTemplate | None:
        """The template of a HF model directory (None: it has none), as ``AutoTokenizer``
        finds it: ``chat_template.jinja`` and ``additional_chat_templates/*.jinja`` before
        ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of named ones)."""
        model_dir = Path(model_dir)
        config = _read_json(model_dir / "tokenizer_config.json")
        templates = {}
        if (model_dir / "chat_template.jinja").is_file():
            templates["default"] = (model_dir / "chat_template.jinja").read_text()
        for path in sorted((model_dir / "additional_chat_templates").glob("*.jinja")):
            templates[path.stem] = path.read_text()
        if not templates:
            named = config.get("chat_template")
            if isinstance(named, str):
                templates["default"] = named
            elif isinstance(named, list):
                templates = {t["name"]: t["template"] for t in named if isinstance(t, dict)}
        if not templates:
            return None
        if "added_tokens_decoder" not in config:  # legacy checkpoints name specials here
            config.update(_read_json(model_dir / "special_tokens_map.json"))
        return cls(templates, special_tokens(config))

    def source(self, tools=None) -> tuple[str, str]:
        """``(name, source)`` of the template used: ``tool_use`` for a request with tools
        when the model names one, else ``default``."""
        if tools is not None and "tool_use" in self.templates:
            return "tool_use", self.templates["tool_use"]
        if "default" in self.templates:
            return "default", self.templates["default"]
        names = ", ".join(sorted(self.templates))
        raise ChatTemplateError(f"messages: the model's chat templates ({names}) name no default")

    def render(
        self,
        messages: list,
        add_generation_prompt: bool = False,
        continue_final_message: bool | str = False,
        tools: list | None = None,
        documents: list | None = None,
        **kwargs,
    ) -> str:
        """The prompt text of ``messages`` (template-ready, see ``chat_parts``); ``kwargs``
        are template variables and win over the special tokens."""
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError(
                "continue_final_message: cannot be used together with add_generation_prompt"
            )
        if not isinstance(messages, list) or not messages:
            raise ChatTemplateError("messages: must be a non-empty list")
        if not all(isinstance(m, dict) for m in messages):
            raise ChatTemplateError("messages: each message must be an object")
        for name, value in (("tools", tools), ("documents", documents)):
            if value is not None and not (
                isinstance(value, list) and all(isinstance(v, dict) for v in value)
            ):
                raise ChatTemplateError(f"{name}: must be a list of objects")
        name, source = self.source(tools)
        chat = _alias_reasoning(
            [{k: v for k, v in plain(m).items() if v is not None} for m in messages]
        )
        final = _tag_final(chat, continue_final_message, source) if continue_final_message else None
        variables = {**self.specials, **plain(kwargs)}
        try:
            text = self._template(name, source).render(
                messages=chat,
                tools=plain(tools),
                documents=plain(documents),
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.TemplateError as exc:  # raise_exception() included
            raise ChatTemplateError(f"messages: {exc}") from None
        except Exception as exc:  # the template tripped on this request's data: the client's
            raise ChatTemplateError(f"messages: the chat template failed ({exc!r})") from None
        return text if final is None else _cut_at_tag(text, final)

    def _template(self, name: str, source: str) -> jinja2.Template:
        compiled = self._compiled.get(name)
        if compiled is None:  # a race compiles twice at worst
            compiled = self._compiled[name] = template_environment().from_string(source)
        return compiled


def render_options(request) -> dict:
    """``render``'s keyword arguments for an OpenAI chat request (a JSON object, or an
    object with these attributes): ``add_generation_prompt`` (default true),
    ``continue_final_message``, ``tools``, ``documents``, then ``chat_template_kwargs``
    (which win, and may not set a reserved name)."""
    get = request.get if isinstance(request, Mapping) else lambda k: getattr(request, k, None)
    add = get("add_generation_prompt")
    options = {
        "add_generation_prompt": True if add is None else add,
        "continue_final_message": get("continue_final_message") or False,
        "tools": get("tools"),
        "documents": get("documents"),
    }
    extra = get("chat_template_kwargs")
    if extra is None:
        return options
    if not isinstance(extra, Mapping) or not all(isinstance(k, str) for k in extra):
        raise ChatTemplateError("chat_template_kwargs: must be an object")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & extra.keys())
    if reserved:
        raise ChatTemplateError(f"chat_template_kwargs: {', '.join(reserved)} cannot be set")
    return {**options, **extra}


def special_tokens(config: Mapping) -> dict[str, str]:
    """The named special tokens a template sees, from ``tokenizer_config.json``: the
    standard ones, any other ``*_token`` entry, and ``extra_special_tokens`` given by name."""
    named = {}
    for key, value in config.items():
        if key in NAMED_SPECIALS or key.endswith("_token"):
            named[key] = value
    for key in ("extra_special_tokens", "model_specific_special_tokens"):
        if isinstance(config.get(key), Mapping):
            named.update(config[key])
    out = {}
    for key, value in named.items():
        text = value.get("content") if isinstance(value, Mapping) else value
        if isinstance(text, str):
            out[key] = text
    return out


def plain(value):
    """A fresh copy of ``value`` made of JSON types (tuples kept); anything else becomes an
    inert ``<TypeName>`` string, so a template sees no object with methods."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for kind, exact in ((str, str.__str__), (int, int.__int__), (float, float.__float__)):
        if isinstance(value, kind):  # a subclass (an enum, ...) loses its extra methods
            return exact(value)
    if isinstance(value, Mapping):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        copied = [plain(v) for v in value]
        return copied if isinstance(value, list) else tuple(copied)
    return f"<{type(value).__name__}>"


def _alias_reasoning(chat: list[dict]) -> list[dict]:
    """Reasoning under any of its names is also ``reasoning_content`` and ``thinking``."""
    out = []
    for message in chat:
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _tag_final(chat: list[dict], field: bool | str, source: str) -> str:
    """Mark the end of the final message's text (edits ``chat``); returns that text."""
    field = field if isinstance(field, str) else "content"
    last = chat[-1]
    final = last.get(field)
    if final is None:
        raise ChatTemplateError(f"continue_final_message: the final message has no {field}")
    fields = [field]
    if field in REASONING_FIELDS:
        fields = [f for f in REASONING_FIELDS if last.get(f) == final]
    if not any(f in source for f in fields):
        raise ChatTemplateError(f"continue_final_message: the template never reads {field}")
    if isinstance(final, list | tuple):
        for block in reversed(final):
            if isinstance(block, dict) and "text" in block:
                final = block["text"]
                block["text"] = block["text"] + _CONTINUE_TAG
                return final
        raise ChatTemplateError("continue_final_message: the final message has no text")
    for f in fields:
        last[f] = last[f] + _CONTINUE_TAG
    return final


def _cut_at_tag(text: str, final: str) -> str:
    """The rendered text up to the end of the final message (where the tag landed)."""
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise ChatTemplateError(
            "continue_final_message: the template does not render the final message as given"
        )
    at = text.rindex(tag)
    if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()  # the template trimmed the message's trailing spaces


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else {}
