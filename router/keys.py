"""The router's own chained block keys (llm-d style).

A key names a block by its tokens and everything before it:
``key_i = H(key_{i-1} || tokens_i)`` with a root that depends on the LoRA name only.
The router derives the same keys from an engine's ``BlockStored`` events and from a
request's token ids, whatever hash algorithm or seed the engine uses.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from hashlib import blake2b


def root_key(lora_name: str | None = None) -> int:
    """The parent key of a prompt's first block."""
    seed = b"epdserve-router-root\x00" + (lora_name or "").encode()
    return int.from_bytes(blake2b(seed, digest_size=8).digest(), "little")


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as packed uint32 (raises OverflowError/TypeError on invalid ids)."""
    return array("I", token_ids).tobytes()


def chain_keys(parent: int, packed: bytes, block_size: int, num_blocks: int) -> list[int]:
    """Keys of ``num_blocks`` consecutive blocks whose packed tokens follow ``parent``."""
    keys = []
    step = 4 * block_size
    view = memoryview(packed)
    for i in range(num_blocks):
        digest = blake2b(parent.to_bytes(8, "little"), digest_size=8)
        digest.update(view[i * step : (i + 1) * step])
        parent = int.from_bytes(digest.digest(), "little")
        keys.append(parent)
    return keys


def request_keys(
    token_ids: Sequence[int], block_size: int, lora_name: str | None = None
) -> list[int]:
    """Keys of every full block of a request's prompt."""
    num_blocks = len(token_ids) // block_size
    if num_blocks == 0:
        return []
    packed = token_bytes(token_ids[: num_blocks * block_size])
    return chain_keys(root_key(lora_name), packed, block_size, num_blocks)
