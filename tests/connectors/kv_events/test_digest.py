"""The KV-event stream digest: multiset per tier, clears, and answer validation."""

from __future__ import annotations

import msgspec
import pytest

from epdserve.connectors.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from epdserve.connectors.kv_events.digest import (
    DigestAnswer,
    DigestError,
    StreamDigest,
    decode_answer,
    encode_answer,
)


def root_block(h: int, medium: str = "GPU") -> BlockStored:
    return BlockStored([h], None, [h % 1000 + i for i in range(4)], 4, None, medium, None)


def test_the_digest_is_a_multiset_per_tier_and_a_clear_empties_only_the_local_tier():
    d = StreamDigest()
    d.apply([root_block(7), root_block(7), BlockRemoved([7], "GPU"), root_block(9, "STORE")])
    once = StreamDigest()
    once.apply([root_block(7), root_block(9, "STORE")])
    assert d.state() == once.state() and d.state()[0][0] == 1
    d.apply([AllBlocksCleared()])
    assert d.state() == ((0, 0), once.state()[1])


def test_digest_answers_are_validated():
    answer = DigestAnswer(2**64 - 1, 3, 1, 2**64 - 1, 0, 0)
    assert decode_answer(encode_answer(answer)) == answer
    for bad in (
        b"\xc1",
        msgspec.msgpack.encode([1, 2, 3]),
        msgspec.msgpack.encode([1, -1, 0, 0, 0, 0]),
        msgspec.msgpack.encode([1, 0, 0, -1, 0, 0]),
        msgspec.msgpack.encode([1, 0, "0", 0, 0, 0]),
        msgspec.msgpack.encode([1, 0, 0, 0, 0, 0, 0]),
        bytes(300),
    ):
        with pytest.raises(DigestError):
            decode_answer(bad)


def test_a_block_in_another_kv_cache_group_changes_the_digest():
    plain, grouped = StreamDigest(), StreamDigest()
    plain.apply([root_block(7)])
    other = root_block(7)
    other.group_idx = 1
    grouped.apply([other])
    assert plain.state()[0][0] == grouped.state()[0][0] and plain.state() != grouped.state()
