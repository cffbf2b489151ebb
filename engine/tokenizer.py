"""Tokenizer straight from a model directory (``tokenizers``); chat templates are
``epdserve.common.chat_template``'s."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer


class TokenizerInfo:
    """Encode and decode with a HF model directory's tokenizer."""

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


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_str(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value
