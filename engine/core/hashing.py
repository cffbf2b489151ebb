"""Chained block hashes (DESIGN.md §3): ``h_i = H((h_{i-1}, tokens_i, extra_keys))``.

Serialization is canonical CBOR, so every process (and language) agrees on a block's
name; ``NONE_HASH = H(hash_seed)`` roots the chain, so pods that share a seed share names.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence

import cbor2

BlockHash = bytes
HashFn = Callable[[object], bytes]


def sha256_cbor(obj: object) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def xxhash_cbor(obj: object) -> bytes:
    import xxhash

    return xxhash.xxh3_128_digest(cbor2.dumps(obj, canonical=True))


def blake3_cbor(obj: object) -> bytes:
    import blake3

    return blake3.blake3(cbor2.dumps(obj, canonical=True)).digest()


HASH_FUNCTIONS: dict[str, HashFn] = {
    "sha256_cbor": sha256_cbor,
    "xxhash_cbor": xxhash_cbor,
    "blake3_cbor": blake3_cbor,
}


def get_hash_fn(name: str) -> HashFn:
    if name not in HASH_FUNCTIONS:
        raise ValueError(
            f"prefix_caching_hash_algo: unknown {name!r}; choose from {', '.join(HASH_FUNCTIONS)}"
        )
    return HASH_FUNCTIONS[name]


def none_hash(hash_fn: HashFn, hash_seed: str | None) -> BlockHash:
    """Root of every chain: from the pool's shared seed, or random when none is given."""
    return hash_fn(hash_seed) if hash_seed is not None else hash_fn(os.urandom(32))


def hash_block(
    hash_fn: HashFn, parent: BlockHash, tokens: Sequence[int], extra_keys: tuple | None = None
) -> BlockHash:
    return hash_fn((parent, tuple(tokens), extra_keys))


class BlockHasher:
    """Extends a request's hash list as its tokens fill whole blocks."""

    def __init__(self, block_size: int, hash_fn: HashFn, root: BlockHash, extra_keys=None):
        self.block_size = block_size
        self.hash_fn = hash_fn
        self.root = root
        self.extra_keys = extra_keys  # e.g. a LoRA name, applying to every block

    def block_extra_keys(
        self, i: int, mm_spans=(), cache_salt: str | None = None, lora_key: tuple = ()
    ):
        """Extra keys of block ``i``: the request's LoRA adapter key, its name and the digest of
        its files (every block, so two adapters, or two versions of one, never share KV),
        identifiers of the multimodal items overlapping it, then, on block 0 only, the
        request's ``cache_salt`` (later blocks inherit it through the chain); None when there
        are none."""
        extra = self.extra_keys
        if mm_spans:
            bs = self.block_size
            ids = tuple(ident for s, e, ident in mm_spans if s < (i + 1) * bs and e > i * bs)
            extra = ids or extra
        if cache_salt and i == 0:
            extra = (*(extra or ()), cache_salt)
        if lora_key:
            extra = (*lora_key, *(extra or ()))
        return extra

    def extend(
        self,
        hashes: list[BlockHash],
        token_ids: Sequence[int],
        mm_spans=(),
        cache_salt: str | None = None,
        lora_key: tuple = (),
    ) -> None:
        """Append hashes for every newly completed block of ``token_ids``.

        ``mm_spans`` are ``(start, end, identifier)`` of multimodal placeholders: a block
        overlapping one carries its identifier, so different images never share blocks;
        ``cache_salt`` (a tenant's) roots the chain apart from every other salt;
        ``lora_key`` (name, digest) keys every block by its adapter.
        """
        bs = self.block_size
        for i in range(len(hashes), len(token_ids) // bs):
            parent = hashes[i - 1] if i > 0 else self.root
            extra = self.block_extra_keys(i, mm_spans, cache_salt, lora_key)
            hashes.append(hash_block(self.hash_fn, parent, token_ids[i * bs : (i + 1) * bs], extra))
