"""The event codec against real vLLM 0.32 frames, the legacy array form and garbage."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from epdserve.connectors.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventDecodeError,
    EventDecoder,
    EventEncoder,
    KVEventsConfig,
    binds,
)

# the reference captures live beside the checkout: <project root>/../shared/testdata
ROOT = Path(__file__).resolve().parents[3]
CAPTURE = ROOT.parent / "shared" / "testdata" / "vllm-0.32" / "events"
FRAMES = sorted(CAPTURE.glob("seq-*.bin"))
needs_capture = pytest.mark.skipif(not FRAMES, reason="vLLM capture not present")


@needs_capture
@pytest.mark.parametrize("frame", FRAMES, ids=lambda p: p.stem)
def test_reencoding_a_vllm_frame_gives_the_same_bytes(frame):
    payload = frame.read_bytes()
    assert EventEncoder().encode(EventDecoder().decode(payload)) == payload


@needs_capture
def test_decoded_capture_matches_its_json_index():
    index = json.loads((CAPTURE / "index.json").read_text())
    first = EventDecoder().decode((CAPTURE / index[0]["payload_file"]).read_bytes())
    stored = first.events[0]
    expected = index[0]["payload"][1][0]
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == expected["block_hashes"]
    assert stored.token_ids == expected["token_ids"]
    assert stored.parent_block_hash is None and stored.block_size == 32


def test_encoder_omits_default_fields_and_tags_events_first():
    batch = EventBatch(1.5, [BlockRemoved([7], "GPU", 0), AllBlocksCleared()], 0)
    raw = msgspec.msgpack.decode(EventEncoder().encode(batch))
    assert raw == [
        1.5,
        [
            {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU", "group_idx": 0},
            {"type": "AllBlocksCleared"},
        ],
        0,
    ]
    assert list(raw[1][0])[0] == "type"


def test_block_hashes_are_written_as_uint64():
    h = (1 << 63) + 5
    payload = EventEncoder().encode(EventBatch(0.0, [BlockRemoved([h], "GPU")], 0))
    assert b"\xcf" + h.to_bytes(8, "big") in payload


def test_decoder_accepts_the_legacy_array_form_and_byte_hashes():
    legacy = [
        2.0,
        [
            [
                "BlockStored",
                [1, b"\x00" * 24 + (9).to_bytes(8, "big")],
                None,
                [5, 6, 7, 8],
                2,
                None,
                "GPU",
            ],
            ["BlockRemoved", [3], "GPU"],
            ["AllBlocksCleared"],
        ],
        0,
    ]
    batch = EventDecoder().decode(msgspec.msgpack.encode(legacy))
    stored, removed, cleared = batch.events
    assert stored.block_hashes == [1, 9] and stored.token_ids == [5, 6, 7, 8]
    assert removed.block_hashes == [3] and isinstance(cleared, AllBlocksCleared)


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\x93",
        b"\xc1\xc1",
        msgspec.msgpack.encode({"ts": 1}),
        msgspec.msgpack.encode([1.0, [{"type": "Nope"}], 0]),
        msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": "x"}], 0]),
    ],
)
def test_decoder_rejects_garbage_with_a_decode_error(payload):
    with pytest.raises(EventDecodeError):
        EventDecoder().decode(payload)


def test_decoder_rejects_token_counts_that_do_not_fill_the_blocks():
    bad = EventBatch(0.0, [BlockStored([1, 2], None, [1, 2, 3], 2, None, "GPU", None)], 0)
    with pytest.raises(EventDecodeError, match="token_ids"):
        EventDecoder().decode(EventEncoder().encode(bad))


def test_config_parses_vllm_keys_and_fills_defaults():
    cfg = KVEventsConfig.parse(
        '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557",'
        '"replay_endpoint":"tcp://*:5558","topic":"kv@1.2.3.4:8000@m","buffer_steps":10000}'
    )
    assert cfg.active and cfg.hwm == 100_000 and cfg.max_queue_size == 100_000
    assert KVEventsConfig.parse('{"enable_kv_cache_events":true}').publisher == "zmq"
    assert not KVEventsConfig.parse("{}").active


@pytest.mark.parametrize(
    "text, field",
    [
        ('{"bogus": 1}', "bogus"),
        ('{"publisher": "kafka"}', "publisher"),
        ('{"buffer_steps": 0}', "buffer_steps"),
        ("[1]", "object"),
        ("{", "JSON"),
    ],
)
def test_config_errors_name_the_field(text, field):
    with pytest.raises(ValueError, match=field):
        KVEventsConfig.parse(text)


def test_bind_or_connect_follows_vllms_rule():
    assert binds("tcp://*:5557") and binds("ipc:///tmp/x") and binds("inproc://x")
    assert not binds("tcp://10.0.0.1:5557")
