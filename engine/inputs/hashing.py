"""Multimodal identifiers: blake3 over model id + modality-tagged item bytes + processor kwargs.

The identifier keys the processor cache, the encoder cache, the encoder-cache connector
and the block-hash extra keys, so every process (and pod) names an image the same way. A
request with a ``cache_salt`` renames its items (``salted_id``) before any of those sees
them, so a tenant's encoder outputs are shared with no other salt, and which images another
tenant sent cannot be learnt from the encoder cache or the store.
"""

from __future__ import annotations

import blake3
import cbor2


def mm_hash(model_id: str, modality: str, item: bytes, processor_kwargs: dict | None = None) -> str:
    hasher = blake3.blake3()
    hasher.update(
        cbor2.dumps(["epdserve-mm-v1", model_id, modality, processor_kwargs or {}], canonical=True)
    )
    hasher.update(item)
    return hasher.hexdigest()


def salted_id(identifier: str, cache_salt: str) -> str:
    """The identifier of an item of a request with ``cache_salt``: blake3 over the salt and
    the unsalted identifier, a crop's ``.<crop>`` suffix kept (a placeholder's crop index)."""
    base, dot, crop = identifier.partition(".")
    hasher = blake3.blake3(cbor2.dumps(["epdserve-mm-salt-v1", cache_salt, base], canonical=True))
    return hasher.hexdigest() + dot + crop


def image_item_bytes(raw: bytes | None, image) -> bytes:
    """The original encoded bytes when known, else mode + size + pixels."""
    if raw:
        return b"encoded:" + raw
    header = f"pixels:{image.mode}:{image.width}x{image.height}:".encode()
    return header + image.tobytes()
