"""Prompt tokenization for routing: ``tokenizers`` + the model's jinja chat template.

The router must see the same token ids as the engine, so it follows the HF/vLLM
conventions: completions add special tokens (the tokenizer's post-processor), chat
requests render the chat template and tokenize without adding special tokens.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer


class PromptError(ValueError):
    """A request whose prompt the router cannot tokenize."""


def _raise(message: str) -> None:
    raise PromptError(message)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # AddedToken serialised as a dict
        return value.get("content")
    return value


def _load_template(model_dir: Path, config: dict) -> str | None:
    path = model_dir / "chat_template.jinja"
    if path.exists():
        return path.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        return named.get("default")
    return template


class PromptTokenizer:
    """Turns completion and chat request bodies into prompt token ids."""

    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise ValueError(f"--model: no tokenizer.json in {model_dir}")
        self._tokenizer = Tokenizer.from_file(str(path))
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        self._specials = {
            name: _token_text(config.get(name)) or ""
            for name in ("bos_token", "eos_token", "pad_token", "unk_token")
        }
        source = _load_template(model_dir, config)
        self._template = self._compile(source) if source else None

    @staticmethod
    def _compile(source: str):
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(
            x, ensure_ascii=False, indent=indent
        )
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env.from_string(source)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids of ``text``."""
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def completion_ids(self, body: dict) -> list[int]:
        """Prompt ids of a ``/v1/completions`` body (first prompt of a batch)."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch: route on the first prompt
        if isinstance(prompt, str):
            return self.encode(prompt, bool(body.get("add_special_tokens", True)))
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        raise PromptError("prompt must be a string, a list of token ids, or a batch of them")

    def render_chat(self, body: dict) -> str:
        """The chat template applied to a ``/v1/chat/completions`` body."""
        if self._template is None:
            raise PromptError("the model has no chat template")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise PromptError("messages must be a non-empty list")
        continue_final = bool(body.get("continue_final_message", False))
        kwargs = dict(body.get("chat_template_kwargs") or {})
        kwargs.setdefault(
            "add_generation_prompt",
            bool(body.get("add_generation_prompt", True)) and not continue_final,
        )
        text = self._template.render(
            messages=messages,
            tools=body.get("tools"),
            documents=body.get("documents"),
            **self._specials,
            **kwargs,
        )
        if continue_final and isinstance(messages[-1].get("content"), str):
            end = text.rfind(messages[-1]["content"].strip())
            if end >= 0:
                text = text[: end + len(messages[-1]["content"].strip())]
        return text

    def chat_ids(self, body: dict) -> list[int]:
        """Prompt ids of a chat body (template, then tokenize without special tokens)."""
        return self.encode(self.render_chat(body), bool(body.get("add_special_tokens", False)))
