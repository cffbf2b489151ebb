"""An adapter's identity by content: a digest of its config and weights files.

Two loads of the same name from different files are different adapters: the digest joins the
name wherever a KV block is named (block-hash extra keys, store keys through them, KV events,
the router's index), so a reload or an in-place swap never meets the old adapter's blocks.
Two names over the same bytes share one digest, so the core reads them once.
"""

from __future__ import annotations

import os
from pathlib import Path

import blake3

from epdserve.engine.lora.peft_files import (
    CONFIG_FILE,
    MAX_CONFIG_BYTES,
    WEIGHTS_FILE,
    open_regular,
)

DIGEST_CHARS = 32  # hex of 128 bits
CHUNK = 8 << 20


def content_digest(config: bytes, weights: bytes) -> str:
    """The digest of an adapter's two files' bytes (each length-prefixed)."""
    h = blake3.blake3()
    for part in (config, weights):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest(length=DIGEST_CHARS // 2)


def read_config_bytes(root: Path) -> bytes:
    """``adapter_config.json``'s bytes, at most ``MAX_CONFIG_BYTES``; ``ValueError`` beyond."""
    with open_regular(root / CONFIG_FILE) as f:
        data = f.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise ValueError(f"{CONFIG_FILE}: larger than {MAX_CONFIG_BYTES} bytes")
    return data


def read_weights(path: str | Path) -> tuple[bytes, str]:
    """The adapter's weights file's bytes and the digest of its files as read now (what the
    core loads: the bytes it checks are the bytes it uses)."""
    root = Path(path)
    try:
        config = read_config_bytes(root)
        with open_regular(root / WEIGHTS_FILE) as f:
            weights = f.read()
    except OSError as exc:
        raise ValueError(f"lora_path: cannot read the adapter ({exc.strerror or exc})") from None
    return weights, content_digest(config, weights)


def adapter_digest(path: str | Path) -> str:
    """The digest of the adapter directory ``path`` (its weights streamed, not held);
    ``ValueError`` naming ``lora_path`` when a file cannot be read."""
    root = Path(path)
    try:
        config = read_config_bytes(root)
        h = blake3.blake3()
        h.update(len(config).to_bytes(8, "little"))
        h.update(config)
        with open_regular(root / WEIGHTS_FILE) as f:
            h.update(os.fstat(f.fileno()).st_size.to_bytes(8, "little"))
            while chunk := f.read(CHUNK):
                h.update(chunk)
    except OSError as exc:
        raise ValueError(f"lora_path: cannot read the adapter ({exc.strerror or exc})") from None
    return h.hexdigest(length=DIGEST_CHARS // 2)
