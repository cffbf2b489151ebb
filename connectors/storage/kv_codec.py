"""Stored KV values (format v3) on the codec of ``codec.py``: one value per (block, slice of
KV heads), the slice a tensor-parallel rank holds (every head at TP 1).

A value holds KV heads ``first .. first+count-1`` of the model's ``num_kv_heads`` for one
block, ``[layers, 2, tokens, count, head_dim]`` (the paged cache's own layout, so a TP 1 pod
saves a block row as it is); its metadata names the model's head count, the slice
(``kv_heads``: ``"first+count"``) and the rank that wrote it (``tp``: ``"rank/size"``,
recorded, never checked), so a reader at any TP finds in it the heads it holds (``kv_io.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from epdserve.connectors.storage.codec import Decoded, check_tensor, decode_tensor, encode_tensor

# 3: a value holds a slice of the KV heads; the model's head count and the slice in its header
KV_FORMAT_VERSION = 3
# one block (of some of its KV heads) of a paged cache [blocks, layers, 2, block_size, heads, dim]
KV_LAYOUT = "layer,kv,token,head,dim"
KV_TENSOR = "kv"


@dataclass(frozen=True)
class KVBlockMeta:
    """What a stored KV value must agree on with its reader (besides key, shape and dtype),
    whatever tensor-parallel shape wrote it: ``num_kv_heads`` is the model's, not a rank's."""

    fingerprint: str
    block_size: int
    hash_algo: str
    num_kv_heads: int
    layout: str = KV_LAYOUT
    version: int = KV_FORMAT_VERSION

    def to_metadata(self) -> dict[str, str]:
        return {
            "format": "epd-kv",
            "version": str(self.version),
            "fingerprint": self.fingerprint,
            "layout": self.layout,
            "block_size": str(self.block_size),
            "num_kv_heads": str(self.num_kv_heads),
            "hash_algo": self.hash_algo,
        }


class KVPart(NamedTuple):
    """Which KV heads of a block a stored value holds (``first .. first+count-1`` of the
    model's), and the tensor-parallel rank that wrote it."""

    first: int
    count: int
    tp_rank: int = 0
    tp_size: int = 1

    def to_metadata(self) -> dict[str, str]:
        return {"kv_heads": f"{self.first}+{self.count}", "tp": f"{self.tp_rank}/{self.tp_size}"}


def encode_kv_block(
    tensor: torch.Tensor, meta: KVBlockMeta, key: str, part: KVPart | None = None
) -> bytes:
    """Safetensors bytes of one block's span (``[layers, 2, tokens, heads, dim]``, of the KV
    heads ``part`` names), to be stored under ``key``."""
    extra = part.to_metadata() if part is not None else {}
    return encode_tensor(KV_TENSOR, tensor, {**meta.to_metadata(), **extra, "key": key})


def decode_kv_block(
    data: bytes | memoryview,
    expected_meta: KVBlockMeta,
    expected_shape: tuple[int, ...],
    dtype: torch.dtype,
    key: str,
    out: torch.Tensor | None = None,
    heads: tuple[int, int] | None = None,
) -> Decoded:
    """The block read from ``key`` (into ``out`` when given), or why it was refused;
    ``heads``: the ``(first, count)`` the value must hold (its writer's rank is not checked)."""
    metadata = _kv_metadata(expected_meta, key, heads)
    return decode_tensor(data, KV_TENSOR, metadata, expected_shape, dtype, out)


def check_kv_block(
    data,
    expected_meta: KVBlockMeta,
    expected_shape,
    dtype,
    key: str,
    heads: tuple[int, int] | None = None,
) -> tuple[memoryview | None, str]:
    """As ``decode_kv_block`` without the copy: the payload's bytes, or why it was refused."""
    metadata = _kv_metadata(expected_meta, key, heads)
    return check_tensor(data, KV_TENSOR, metadata, expected_shape, dtype)


def _kv_metadata(meta: KVBlockMeta, key: str, heads: tuple[int, int] | None) -> dict[str, str]:
    metadata = {**meta.to_metadata(), "key": key}
    if heads is not None:
        metadata["kv_heads"] = f"{heads[0]}+{heads[1]}"
    return metadata
