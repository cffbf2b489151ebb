"""A compact digest of the blocks a pod's event stream says it holds, and its wire form.

Both ends compute it the same way from the same batches: the publisher over every batch it
sends, a router over every batch it applies. Per tier (``local``: the pod's own cache,
``store``: the pool's shared store) it keeps the number of stored blocks and the sum, modulo
2**64, of a mixed form of each block hash (removals subtract), so a multiset of hashes (a
pod may cache one hash twice) keeps a stable digest and ``AllBlocksCleared`` empties the
local tier. Cost: O(1) per block hash per event (one multiply-xorshift mix), two ints per
tier of state; an answer is ~40 bytes.

Wire: a replay DEALER sends ``[b"", DIGEST_REQUEST]`` (8 bytes, read by a replay server as
a start seq past any buffer, so vLLM and older pods answer only the end marker); a pod of
ours answers ``[b"", b"", DIGEST_REQUEST, msgpack DigestAnswer]``, the digest as of every
batch with ``seq < next_seq``, and ``instance``, a random id of its publisher's process.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated

import msgspec

from epdserve.connectors.kv_events.schema import (
    STORE_MEDIUM,
    UINT64_MASK,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
)

DIGEST_REQUEST = b"\x7fDIGEST1"  # as a start seq: 2**63 and more, beyond any buffer
MAX_DIGEST_BYTES = 256  # an answer is ~40 bytes: anything larger is not one
LOCAL, STORE = "local", "store"
_GROUP = 0x9E3779B97F4A7C15  # spreads one hash over KV-cache groups

I64 = Annotated[int, msgspec.Meta(ge=-(1 << 63), le=(1 << 63) - 1)]


class DigestAnswer(msgspec.Struct, array_like=True, forbid_unknown_fields=True, frozen=True):
    """A pod's digest as of ``next_seq`` (every batch before it applied)."""

    instance: int  # uint64 (checked in decode_answer)
    next_seq: Annotated[int, msgspec.Meta(ge=0, le=1 << 62)]
    local_count: I64
    local_sum: int  # uint64
    store_count: I64
    store_sum: int  # uint64

    def tiers(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """``((local count, sum), (store count, sum))``, as :meth:`StreamDigest.state`."""
        return (self.local_count, self.local_sum), (self.store_count, self.store_sum)


class DigestError(ValueError):
    """A digest answer that does not decode or is out of range."""


_decoder = msgspec.msgpack.Decoder(DigestAnswer)
_encoder = msgspec.msgpack.Encoder()


def encode_answer(answer: DigestAnswer) -> bytes:
    return _encoder.encode(answer)


def decode_answer(payload: bytes) -> DigestAnswer:
    """Validate and decode an answer frame; raises :class:`DigestError` naming the problem."""
    if len(payload) > MAX_DIGEST_BYTES:
        raise DigestError(f"digest answer of {len(payload)} bytes (at most {MAX_DIGEST_BYTES})")
    try:
        answer = _decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise DigestError(f"invalid digest answer: {exc}") from None
    for name in ("instance", "local_sum", "store_sum"):
        if not 0 <= getattr(answer, name) <= UINT64_MASK:
            raise DigestError(f"invalid digest answer: {name} is not a uint64")
    return answer


def mix(block_hash: int, group_idx: int | None) -> int:
    """A 64-bit finalizer of one (hash, group): sums of mixed values are hard to collide."""
    x = (block_hash + (group_idx or 0) * _GROUP) & UINT64_MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & UINT64_MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & UINT64_MASK
    return x ^ (x >> 31)


class StreamDigest:
    """The running digest of one event stream (not thread-safe: callers hold a lock)."""

    __slots__ = ("_count", "_sum")

    def __init__(self, state: tuple[tuple[int, int], tuple[int, int]] | None = None) -> None:
        (lc, ls), (sc, ss) = state or ((0, 0), (0, 0))
        self._count = {LOCAL: lc, STORE: sc}
        self._sum = {LOCAL: ls, STORE: ss}

    def apply(self, events: Iterable) -> None:
        """Fold one batch's events in."""
        for event in events:
            if isinstance(event, AllBlocksCleared):  # the pod's own cache; the store stays
                self._count[LOCAL] = self._sum[LOCAL] = 0
                continue
            if not isinstance(event, BlockStored | BlockRemoved):
                continue
            tier = STORE if event.medium == STORE_MEDIUM else LOCAL
            sign = 1 if isinstance(event, BlockStored) else -1
            total = sum(mix(h, event.group_idx) for h in event.block_hashes)
            self._count[tier] += sign * len(event.block_hashes)
            self._sum[tier] = (self._sum[tier] + sign * total) & UINT64_MASK

    def state(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """``((local count, sum), (store count, sum))``."""
        return (self._count[LOCAL], self._sum[LOCAL]), (self._count[STORE], self._sum[STORE])

    def answer(self, instance: int, next_seq: int) -> DigestAnswer:
        (lc, ls), (sc, ss) = self.state()
        return DigestAnswer(instance, next_seq, lc, ls, sc, ss)
