"""The router's own chained block keys (llm-d style).

A key names a block by its tokens and everything before it:
``key_i = H(key_{i-1} || tokens_i)`` with a root that depends on the LoRA name and the
request's ``cache_salt``: as in the engine, where the salt is an extra key of block 0 only,
salted chains share no key with other salts or with unsalted prompts. The router derives the
same keys from an engine's ``BlockStored`` events and from a request's token ids, whatever
hash algorithm or seed the engine uses.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from hashlib import blake2b


def root_key(
    lora_name: str | None = None, cache_salt: str | None = None, lora_digest: str | None = None
) -> int:
    """The parent key of a prompt's first block (an empty salt is no salt, as in vLLM). An
    adapter's digest (the content of its files, ``lora_digest`` in our pods' events) joins its
    name: two versions of an adapter name different blocks."""
    lora = (lora_name or "").encode()
    if lora_name and lora_digest:
        lora += b"\x00" + lora_digest.encode()
    if cache_salt:
        seed = b"epdserve-router-salted-root\x00" + len(lora).to_bytes(4, "little") + lora
        seed += cache_salt.encode("utf-8", "surrogatepass")
    else:
        seed = b"epdserve-router-root\x00" + lora
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


def extend_keys(
    keys: list[int],
    token_ids: Sequence[int],
    block_size: int,
    end: int,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    lora_digest: str | None = None,
) -> list[int]:
    """Append to ``keys`` (a prompt's chain so far) the keys of blocks ``len(keys)..end-1``
    of ``token_ids``; returns ``keys``. Callers keep the list between calls, so a growing
    request hashes each block once."""
    start = len(keys)
    if end > start:
        parent = keys[-1] if keys else root_key(lora_name, cache_salt, lora_digest)
        packed = token_bytes(token_ids[start * block_size : end * block_size])
        keys += chain_keys(parent, packed, block_size, end - start)
    return keys


def request_keys(
    token_ids: Sequence[int],
    block_size: int,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    lora_digest: str | None = None,
) -> list[int]:
    """Keys of every full block of a request's prompt."""
    num_blocks = len(token_ids) // block_size
    if num_blocks == 0:
        return []
    packed = token_bytes(token_ids[: num_blocks * block_size])
    return chain_keys(root_key(lora_name, cache_salt, lora_digest), packed, block_size, num_blocks)


def without_lora(extra_keys: list | None, lora_name: str | None) -> list | None:
    """A ``BlockStored``'s per-block extra keys less the adapter's name.

    Engines key every block of an adapter's request by the adapter's name, first among the
    block's extra keys (vLLM 0.32 sends it bare: ``[["sql"], ["sql"], ...]``; so do our pods).
    The event's ``lora_name`` already carries it and the router's root key covers it, so it is
    dropped here: left in, it read as block 0's salt and as an image key on the rest, and an
    adapter's blocks were never indexed.
    """
    if not lora_name or not extra_keys:
        return extra_keys
    out = []
    for keys in extra_keys:
        if isinstance(keys, list | tuple) and keys and keys[0] == lora_name:
            keys = list(keys[1:]) or None
        out.append(keys)
    return out


def first_block_salt(extra_keys: object) -> str | None:
    """The ``cache_salt`` in a prompt's first block's event extra keys, if any.

    vLLM appends the salt to block 0's extra keys, after any image identifiers; only a
    block whose one extra key is a string is read as salted text (an image block is not
    indexed either way: the router cannot name images from a request's body).
    """
    if isinstance(extra_keys, list | tuple) and len(extra_keys) == 1:
        salt = extra_keys[0]
        if isinstance(salt, str) and salt:
            return salt
    return None
