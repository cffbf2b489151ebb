"""Raw access to stored values behind a store's back, to damage them as a faulty disk, a bad
copy or a hostile writer would: Redis commands on the server, file operations on the volume.
Shared by the storage conformance tests and the P/D and E/P/D pool tests."""

from __future__ import annotations

import os

import torch

from epdserve.connectors.storage import KVBlockMeta, encode_kv_block


class RawValues:
    """Reads and damages stored values behind the store's back: Redis commands on the server,
    plain file operations on the volume (what a faulty disk, a bad copy or a hostile writer
    does)."""

    def __init__(self, store):
        self.store = store
        self.client = None
        if hasattr(store.config, "url"):
            import redis

            self.client = redis.Redis.from_url(store.config.url)

    def get(self, key: str) -> bytes | None:
        if self.client is not None:
            return self.client.get(key)
        try:
            with open(self.store.path_of(key), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def set(self, key: str, value: bytes) -> None:
        if self.client is not None:
            self.client.set(key, value)
            return
        with open(self.store.path_of(key), "wb") as f:
            f.write(value)

    def exists(self, key: str) -> bool:
        return self.get(key) is not None

    def flip_bit(self, key: str, offset: int, bit: int = 0) -> None:
        """Flip one bit in place (``SETRANGE`` on Redis, a one-byte write on disk);
        a negative ``offset`` counts from the end."""
        value = self.get(key)
        offset %= len(value)
        byte = bytes([value[offset] ^ (1 << bit)])
        if self.client is not None:
            self.client.setrange(key, offset, byte)
            return
        with open(self.store.path_of(key), "r+b") as f:
            f.seek(offset)
            f.write(byte)

    def truncate(self, key: str, size: int) -> None:
        if self.client is not None:
            self.client.set(key, self.get(key)[:size])
            return
        os.truncate(self.store.path_of(key), size)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()


# Damage done to stored KV blocks between a save and a load.
def nested(depth: int) -> bytes:
    raw = b"[" * depth + b"]" * depth
    return len(raw).to_bytes(8, "little") + raw + bytes(2048)


def flip_data_bit(raw, keys):
    raw.flip_bit(keys[1], -1)
    return {1: "checksum"}


def flip_header_bit(raw, keys):
    raw.flip_bit(keys[0], 10)  # inside "__metadata__": the header names no metadata
    return {0: "not_safetensors"}


def truncate(raw, keys):
    raw.truncate(keys[2], len(raw.get(keys[2])) - 1)
    raw.truncate(keys[3], 100)  # inside the header
    return {2: "truncated", 3: "not_safetensors"}


def pad(raw, keys):
    raw.set(keys[1], raw.get(keys[1]) + bytes(1 << 20))
    return {1: "oversized"}


def swap(raw, keys):
    first, second = raw.get(keys[0]), raw.get(keys[3])
    raw.set(keys[0], second)
    raw.set(keys[3], first)
    return {0: "key", 3: "key"}


def copy_under_another_key(raw, keys):
    raw.set(keys[2], raw.get(keys[1]))  # same model, shape and checksum: only the key differs
    return {2: "key"}


def nest_10000(raw, keys):
    raw.set(keys[0], nested(10_000))  # longer than any header may be
    raw.set(keys[1], nested(8_000))  # fits: refused for its depth, before json sees it
    return {0: "header_too_large", 1: "too_deep"}


def not_safetensors(raw, keys):
    raw.set(keys[3], b"hello")
    return {3: "not_safetensors"}


def older_format(raw, keys):
    meta = KVBlockMeta("tiny-llama-0123", 4, "sha256_cbor", 2, version=1)
    raw.set(keys[1], encode_kv_block(torch.zeros(2, 2, 4, 2, 8), meta, keys[1]))
    return {1: "format"}


KV_DAMAGE = [  # each takes (raw, 4+ keys) and returns {key index: the reason it is refused}
    flip_data_bit,
    flip_header_bit,
    truncate,
    pad,
    swap,
    copy_under_another_key,
    nest_10000,
    not_safetensors,
    older_format,
]
