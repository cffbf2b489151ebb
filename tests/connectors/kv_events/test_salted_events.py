"""Salted blocks on the wire: router keys instead of tokens and salt; everything else stays
byte for byte what vLLM 0.32 sends (checked against its captures)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from epdserve.connectors.kv_events import (
    BlockStored,
    EventBatch,
    EventDecodeError,
    EventDecoder,
    EventEncoder,
    to_wire_event,
)
from epdserve.connectors.kv_events.keys import extend_keys, request_keys
from epdserve.engine.core import block_pool

ROOT = Path(__file__).resolve().parents[3]
CAPTURE = ROOT.parent / "shared" / "testdata" / "vllm-0.32" / "events"
FRAMES = sorted(CAPTURE.glob("seq-*.bin"))
SALT = "tenant-secret-7f3a"
TOKENS = list(range(700, 764))  # 4 blocks of 16


def engine_event(wire):
    """The engine's own event object for a decoded wire event (32-byte hashes)."""

    def h(value: int) -> bytes:
        return b"\x5a" * 24 + value.to_bytes(8, "big")

    if isinstance(wire, BlockStored):
        parent = None if wire.parent_block_hash is None else h(wire.parent_block_hash)
        return block_pool.BlockStored(
            [h(x) for x in wire.block_hashes], parent, wire.token_ids, wire.block_size, []
        )
    if type(wire).__name__ == "BlockRemoved":
        return block_pool.BlockRemoved([h(x) for x in wire.block_hashes])
    return block_pool.AllBlocksCleared()


@pytest.mark.skipif(not FRAMES, reason="vLLM capture not present")
@pytest.mark.parametrize("frame", FRAMES, ids=lambda p: p.stem)
def test_the_engines_unsalted_events_encode_as_vllms_bytes(frame):
    payload = frame.read_bytes()
    batch = EventDecoder().decode(payload)
    ours = EventBatch(batch.ts, [to_wire_event(engine_event(e)) for e in batch.events], 0)
    assert EventEncoder().encode(ours) == payload


def salted_payload() -> bytes:
    keys = request_keys(TOKENS, 16, cache_salt=SALT)
    event = block_pool.BlockStored(
        [bytes([i]) * 32 for i in range(4)], None, [], 16, [], 0, router_keys=keys
    )
    return EventEncoder().encode(EventBatch(1.0, [to_wire_event(event)], 0))


def test_a_salted_event_holds_no_token_id_and_no_salt():
    payload = salted_payload()
    assert SALT.encode() not in payload
    (raw,) = msgspec.msgpack.decode(payload)[1]
    assert raw["token_ids"] == [] and "extra_keys" not in raw
    assert raw["router_keys"] == request_keys(TOKENS, 16, cache_salt=SALT)
    packed_tokens = msgspec.msgpack.encode(TOKENS[:16])[1:]  # the first block's ids in a row
    assert packed_tokens not in payload


def test_the_engine_side_tokens_never_reach_the_wire_when_keys_are_set():
    event = block_pool.BlockStored([b"\x01" * 32], None, TOKENS[:16], 16, [(SALT,)], 0, [7])
    wire = to_wire_event(event)
    assert wire.token_ids == [] and wire.extra_keys is None and wire.router_keys == [7]


def test_salted_events_decode_with_their_keys():
    (event,) = EventDecoder().decode(salted_payload()).events
    assert event.router_keys == request_keys(TOKENS, 16, cache_salt=SALT)
    assert event.token_ids == []


@pytest.mark.parametrize(
    ("tokens", "keys"),
    [(list(range(16)), [1]), ([], [1, 2])],
    ids=["keys-with-tokens", "more-keys-than-blocks"],
)
def test_router_keys_come_without_tokens_and_at_most_one_per_block(tokens, keys):
    bad = BlockStored([1], None, tokens, 16, None, "GPU", None, None, 0, router_keys=keys)
    with pytest.raises(EventDecodeError, match="router_keys"):
        EventDecoder().decode(EventEncoder().encode(EventBatch(0.0, [bad], 0)))


def test_extend_keys_continues_a_chain_as_request_keys_computes_it():
    keys: list[int] = []
    extend_keys(keys, TOKENS, 16, 1, cache_salt=SALT)
    extend_keys(keys, TOKENS, 16, 4, cache_salt=SALT)
    assert keys == request_keys(TOKENS, 16, cache_salt=SALT)
