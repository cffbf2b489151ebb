"""Prompt tokenization for routing: ``tokenizers`` + the one chat-template renderer.

The router must see the same token ids as the engine, so it follows the HF/vLLM
conventions: completions add special tokens (the tokenizer's post-processor), chat
requests render the chat template (``epdserve.common.chat_template``, the engine's own
renderer) and tokenize without adding special tokens. Only text-only chats are tokenized
here: image placeholders are the pods' to expand.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from epdserve.common.chat_parts import template_messages
from epdserve.common.chat_template import ChatTemplate, render_options


class PromptError(ValueError):
    """A request whose prompt the router cannot tokenize."""


class PromptTokenizer:
    """Turns completion and chat request bodies into prompt token ids."""

    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise ValueError(f"--model: no tokenizer.json in {model_dir}")
        self._tokenizer = Tokenizer.from_file(str(path))
        self._template = ChatTemplate.from_dir(model_dir)

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
        """The chat template applied to a text-only ``/v1/chat/completions`` body."""
        if self._template is None:
            raise PromptError("the model has no chat template")
        try:
            messages, images = template_messages(body.get("messages"))
            if images:
                raise PromptError("messages: images are expanded by the pods, not the router")
            return self._template.render(messages, **render_options(body))
        except PromptError:
            raise
        except ValueError as exc:  # ChatTemplateError included: the pod names it to the client
            raise PromptError(str(exc)) from None

    def chat_ids(self, body: dict) -> list[int]:
        """Prompt ids of a chat body (template, then tokenize without special tokens)."""
        return self.encode(self.render_chat(body), bool(body.get("add_special_tokens", False)))
