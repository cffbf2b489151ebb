"""Tokenizer and chat template straight from a model directory (``tokenizers`` + jinja2)."""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path

from tokenizers import Tokenizer


class TokenizerInfo:
    """Encode, decode, and render the chat template of a HF model directory."""

    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        self.model_dir = str(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"model: no tokenizer.json in {model_dir}")
        self.tokenizer = Tokenizer.from_file(str(path))
        config = _read_json(model_dir / "tokenizer_config.json")
        self.bos_token = _token_str(config.get("bos_token"))
        self.eos_token = _token_str(config.get("eos_token"))
        template = model_dir / "chat_template.jinja"
        self.chat_template = (
            template.read_text() if template.is_file() else config.get("chat_template")
        )
        gen = _read_json(model_dir / "generation_config.json")
        eos = gen.get("eos_token_id", _read_json(model_dir / "config.json").get("eos_token_id"))
        if eos is None and self.eos_token:
            eos = self.tokenizer.token_to_id(self.eos_token)
        self.eos_token_ids = (
            tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        )

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    @cached_property
    def hf(self):
        """transformers' tokenizer of the checkpoint: its ``apply_chat_template`` is the one
        chat-template renderer (the router renders with it too)."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.model_dir)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs
    ) -> str:
        """The prompt text of ``messages``; ``kwargs`` are template variables
        (``chat_template_kwargs``, ``tools``, ...). Errors are ``ValueError``s naming the part."""
        from jinja2 import TemplateError

        if not self.chat_template:
            raise ValueError("messages: this model has no chat template")
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
        if reserved:
            raise ValueError(f"chat_template_kwargs: {', '.join(reserved)} cannot be set")
        try:
            return self.hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
            )
        except TemplateError as exc:
            raise ValueError(f"messages: {exc}") from None


# apply_chat_template's own arguments: a client must not reach them through template variables
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "chat_template",
        "add_generation_prompt",
    }
)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_str(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value
