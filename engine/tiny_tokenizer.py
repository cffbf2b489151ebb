"""A byte-level BPE tokenizer trained on the Python standard library's own sources.

No tokenizer can be downloaded here, so ``make-model`` trains one: deterministic for a
given Python installation (files are read in sorted order, training is single-threaded).
"""

from __future__ import annotations

import functools
import os
import sysconfig
from pathlib import Path

BOS, EOS, PAD = "<|bos|>", "<|endoftext|>", "<|pad|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
BOI, IMAGE, EOI = "<start_of_image>", "<image_soft_token>", "<end_of_image>"
TEXT_SPECIALS = [PAD, BOS, EOS, IM_START, IM_END]
IMAGE_SPECIALS = [BOI, IMAGE, EOI]

# ChatML. Content may be a string or OpenAI-style parts; an image part becomes the
# processor's begin-of-image marker, which the Gemma3 processor expands.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- elif part['type'] in ('image', 'image_url') -%}{{ '<start_of_image>' }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def stdlib_sources(limit_bytes: int = 12_000_000) -> list[str]:
    """The stdlib's ``.py`` files (tests excluded), sorted, up to ``limit_bytes``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if rel[0] in ("test", "site-packages", "idlelib") or "tests" in rel:
            continue
        files.append(str(path))
    out, total = [], 0
    for f in files:
        total += os.path.getsize(f)
        if total > limit_bytes:
            break
        out.append(f)
    return out


@functools.lru_cache(maxsize=4)
def _trained_json(vocab_size: int, with_image_tokens: bool) -> str:
    return _train(vocab_size, with_image_tokens).to_str()


def train_tokenizer(vocab_size: int = 4096, with_image_tokens: bool = False):
    """Return a byte-level BPE ``tokenizers.Tokenizer`` (trained once per process)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_trained_json(vocab_size, with_image_tokens))


def _train(vocab_size: int, with_image_tokens: bool):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # deterministic merges
    specials = TEXT_SPECIALS + (IMAGE_SPECIALS if with_image_tokens else [])
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def texts():
        for f in stdlib_sources():
            yield Path(f).read_text(encoding="utf-8", errors="replace")

    tok.train_from_iterator(texts(), trainer=trainer)
    return tok


def save_hf_tokenizer(tok, out_dir: str, with_image_tokens: bool = False):
    """Wrap ``tok`` as a transformers fast tokenizer and save it; returns the wrapper."""
    from transformers import PreTrainedTokenizerFast

    kwargs = {}
    if with_image_tokens:
        kwargs["extra_special_tokens"] = {"boi_token": BOI, "image_token": IMAGE, "eoi_token": EOI}
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=1 << 20,
        **kwargs,
    )
    hf.save_pretrained(out_dir)
    return hf
