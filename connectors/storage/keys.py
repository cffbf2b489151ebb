"""Key scheme of stored KV blocks and encoder outputs (DESIGN.md §3)."""

from __future__ import annotations

import hashlib
import re

_NAME = re.compile(r"[A-Za-z0-9_.@+=/-]{1,200}")
_HEX = re.compile(r"[0-9a-f]{1,128}")
_ITEM = re.compile(r"[^\s\x00-\x1f\x7f]{1,512}")


def kv_key(
    pool: str,
    fingerprint: str,
    block_hash: bytes | int | str,
    group: int = 0,
    heads: tuple[int, int] | None = None,
) -> str:
    """``epd:kv:{pool}:{fingerprint}:{block_hash_hex}``; hybrid groups > 0 append ``@g{n}``,
    and a value holding only some of the block's KV heads (a tensor-parallel rank's slice)
    ``@h{first}+{count}`` (the model's head numbers: every TP shape names a slice alike).

    ``block_hash`` may be bytes (hex-encoded), a non-negative int (lowercase hex, no
    padding) or an already lowercase-hex string; every pod must pass the same kind.
    """
    key = f"epd:kv:{_name('pool', pool)}:{_name('fingerprint', fingerprint)}:{hash_hex(block_hash)}"
    if group:
        if group < 0:
            raise ValueError(f"group must be >= 0, got {group}")
        key += f"@g{group}"
    if heads is not None:
        first, count = heads
        if first < 0 or count < 1:
            raise ValueError(f"heads must be (first >= 0, count >= 1), got {heads}")
        key += f"@h{first}+{count}"
    return key


def ec_key(pool: str, fingerprint: str, mm_id: str) -> str:
    """``epd:ec:{pool}:{fingerprint}:{mm_id}`` for one multimodal item's encoder output."""
    if not isinstance(mm_id, str) or not _ITEM.fullmatch(mm_id):
        raise ValueError(f"mm_id must be 1-512 printable non-space characters, got {mm_id!r}")
    return f"epd:ec:{_name('pool', pool)}:{_name('fingerprint', fingerprint)}:{mm_id}"


def hash_hex(block_hash: bytes | int | str) -> str:
    """Canonical lowercase hex text of a block hash."""
    if isinstance(block_hash, bytes | bytearray):
        text = bytes(block_hash).hex()
    elif isinstance(block_hash, int) and not isinstance(block_hash, bool) and block_hash >= 0:
        text = format(block_hash, "x")
    elif isinstance(block_hash, str):
        text = block_hash
    else:
        raise ValueError(f"block_hash must be bytes, a non-negative int or hex, got {block_hash!r}")
    if not _HEX.fullmatch(text):
        raise ValueError(f"block_hash must be 1-128 lowercase hex digits, got {text!r}")
    return text


def fingerprint(*parts: object) -> str:
    """A short stable fingerprint (16 hex digits) of what makes stored tensors compatible,
    e.g. ``fingerprint(model_id, revision, dtype, num_layers, kv_heads, head_dim)``."""
    text = "\x1f".join(str(p) for p in parts)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def _name(field: str, value: str) -> str:
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise ValueError(f"{field} must match {_NAME.pattern} (no ':' or spaces), got {value!r}")
    return value
