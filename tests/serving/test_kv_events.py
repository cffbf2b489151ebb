"""A real ``epdserve serve`` publishes vLLM-format KV events from its block pool.

The subscriber here is written from DESIGN.md §3 alone (pyzmq + msgspec), not with our
decoder: ``[topic, seq 8-byte BE, msgpack [ts, [event maps], dp_rank]]``.
"""

from __future__ import annotations

import json
import time

import httpx
import msgspec
import pytest
import zmq
from serving_support import ServerProcess

from epdserve.common import metrics_text


@pytest.fixture
def events_server(models, tmp_path):
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"ipc://{tmp_path}/ev.ipc",
        "replay_endpoint": f"ipc://{tmp_path}/rp.ipc",
        "topic": "kv@test@tiny",
        "buffer_steps": 100,
    }
    srv = ServerProcess(
        str(models.get("llama")),
        "--kv-events-config",
        json.dumps(config),
        "--hash-seed",
        "42",
        api_key=None,
    )
    srv.events_endpoint, srv.replay_endpoint = config["endpoint"], config["replay_endpoint"]
    yield srv
    srv.stop()


def test_block_stored_events_chain_the_prompt_blocks_and_replay_works(events_server):
    srv = events_server
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(srv.events_endpoint)
    time.sleep(0.5)  # let the subscription reach the publisher
    prompt = list(range(100, 150))  # 3 full 16-token blocks + 2 tokens
    resp = httpx.post(
        srv.url + "/v1/completions",
        timeout=30,
        json={"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0},
    )
    assert resp.status_code == 200
    frames = []
    while sub.poll(3000):
        frames.append(sub.recv_multipart())
        if len(frames) >= 1 and not sub.poll(300):
            break
    assert frames, "no KV events received"
    topic, seq, payload = frames[0]
    assert topic == b"kv@test@tiny" and len(seq) == 8
    seqs = [int.from_bytes(f[1], "big", signed=True) for f in frames]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    stored = []
    for _, _, payload in frames:
        ts, events, _rank = msgspec.msgpack.decode(payload)
        assert isinstance(ts, float)
        stored += [e for e in events if e["type"] == "BlockStored"]
    first = stored[0]
    assert first["token_ids"] == prompt[:48] and first["block_size"] == 16
    assert len(first["block_hashes"]) == 3 and first.get("parent_block_hash") is None
    assert all(0 <= h < 2**64 for h in first["block_hashes"])

    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(srv.replay_endpoint)
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    replayed = []
    while dealer.poll(3000):
        msg = dealer.recv_multipart()
        assert msg[0] == b""
        seq = int.from_bytes(msg[2], "big", signed=True)
        if seq == -1:
            assert msg[3] == b""
            break
        replayed.append(seq)
    assert replayed[: len(seqs)] == seqs
    ctx.destroy(linger=0)
    # the publisher's counters reach the pod's /metrics (they travel with the core's stats)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        httpx.post(  # a step after the replay carries the counters over
            srv.url + "/v1/completions",
            timeout=30,
            json={"model": "tiny", "prompt": "x", "max_tokens": 1},
        )
        samples = metrics_text.parse(httpx.get(srv.url + "/metrics", timeout=5).text)
        counts = {
            event: metrics_text.values(samples, "epdserve:kv_event_publisher_total", event=event)
            for event in ("batches_published", "replay_requests")
        }
        if all(counts.values()):
            break
        time.sleep(0.1)
    assert all(len(v) == 1 and v[0] >= 1 for v in counts.values()), counts
