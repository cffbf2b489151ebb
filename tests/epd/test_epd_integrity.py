"""Encoder outputs damaged in the store between the encoder pod's save and the prefill pod's
load (a bit flipped in Redis or on disk, a header nested 8,000 or 10,000 deep): the prefill pod
encodes the image itself, deletes the bad value and counts it; the E -> P -> D answer is 200
and token for token the colocated pod's, on the first try and on a retry, and no engine core
is replaced."""

from __future__ import annotations

import base64
import io
import json
import sys
from pathlib import Path

import httpx
import pytest
from serving_support import ServerProcess

from epdserve.common import metrics_text
from epdserve.connectors.storage import create_store, ec_key
from epdserve.engine.kv_transfer.setup import encoder_fingerprint, weights_digest

sys.path.insert(0, str(Path(__file__).parents[1] / "connectors" / "storage"))
from raw_values import RawValues  # noqa: E402

REJECTED = "epdserve:stored_values_rejected_total"


def nested(depth: int) -> bytes:
    raw = b"[" * depth + b"]" * depth
    return len(raw).to_bytes(8, "little") + raw + bytes(1024)


def flip_last_bit(raw, key):
    raw.flip_bit(key, -1)
    return "checksum"


def nest_8000(raw, key):
    raw.set(key, nested(8_000))  # fits in a header: refused for its depth
    return "too_deep"


def nest_10000(raw, key):
    raw.set(key, nested(10_000))  # longer than any header may be
    return "header_too_large"


DAMAGE = [flip_last_bit, nest_8000, nest_10000]


def image_url(color) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (80, 50), color).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def chat(url: str, **extra) -> dict:
    content = [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "what is in the picture " * 3},
    ]
    return {
        "model": "tiny",
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": True,
        "messages": [{"role": "user", "content": content}],
        **extra,
    }


def post(server, body: dict) -> dict:
    resp = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def tokens(response: dict) -> list[str]:
    return [c["token"] for c in response["choices"][0]["logprobs"]["content"]]


def rejected(server, reason: str) -> float:
    body = httpx.get(server.url + "/metrics", timeout=5).text
    return metrics_text.total(body, REJECTED, kind="encoder_output", reason=reason)


class Pool:
    """Encoder, prefill and decode pods over one store, a colocated reference pod, and raw
    access to the store."""

    def __init__(self, model: str, where: dict):
        key = next(iter(where))

        def config(kind: str, name: str, role: str) -> str:
            extra = {f"{kind}_connector_extra_config": where}
            return json.dumps({f"{kind}_connector": name, f"{kind}_role": role, **extra})

        ec = "RedisECConnector" if key == "url" else "SharedStorageECConnector"
        kv = "RedisConnector" if key == "url" else "SharedStorageConnector"
        common = ("--hash-seed", "pool-seed")
        self.pods: list[ServerProcess] = []
        self.store = create_store(where)
        self.raw = RawValues(self.store)
        self.fingerprint = encoder_fingerprint(weights_digest(model), "float32")
        try:
            for role, extra in (
                ("encoder", ("--ec-transfer-config", config("ec", ec, "ec_producer"))),
                ("prefill", ("--kv-transfer-config", config("kv", kv, "kv_producer"))),
                ("decode", ("--kv-transfer-config", config("kv", kv, "kv_consumer"))),
            ):
                if role != "encoder":
                    extra += ("--ec-transfer-config", config("ec", ec, "ec_consumer"))
                self.pods.append(
                    ServerProcess(model, "--role", role, *extra, *common, api_key=None)
                )
            self.pods.append(ServerProcess(model, *common, api_key=None))
        except Exception:
            self.stop()
            raise
        self.encoder, self.prefill, self.decode, self.colocated = self.pods

    def run(self, url: str) -> dict:
        """E -> P -> D as the router drives it; the decode pod's answer."""
        enc = post(self.encoder, chat(url))
        assert len(enc["ec_transfer_params"]["mm_ids"]) == 1
        pre = post(
            self.prefill, chat(url, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        )
        return post(self.decode, chat(url, kv_transfer_params=pre["kv_transfer_params"]))

    def stop(self) -> None:
        for pod in self.pods:
            pod.stop()
        self.raw.close()
        self.store.close()


# the shared volume's damage cases run in tests/pd and the conformance suite; here they are slow
@pytest.fixture(scope="module", params=["redis", pytest.param("shared", marks=pytest.mark.slow)])
def pool(request, models, tmp_path_factory):
    if request.param == "redis":
        where = {"url": request.getfixturevalue("redis_server").url}
    else:
        where = {"path": str(tmp_path_factory.mktemp("shared") / "cache")}
    started = Pool(str(models.get("gemma3")), where)
    yield started
    started.stop()


@pytest.mark.parametrize("damage", DAMAGE, ids=[d.__name__ for d in DAMAGE])
def test_a_damaged_encoder_output_is_encoded_again_deleted_and_counted(pool, damage):
    url = image_url((40 + 60 * DAMAGE.index(damage), 200, 90))
    expected = post(pool.colocated, chat(url))
    enc = post(pool.encoder, chat(url))
    key = ec_key("default", pool.fingerprint, enc["ec_transfer_params"]["mm_ids"][0])
    assert pool.raw.exists(key)
    reason = damage(pool.raw, key)
    cores = [p.core_pid() for p in pool.pods]
    runs0 = pool.prefill.metric("epdserve:encoder_runs_total")
    before = rejected(pool.prefill, reason)

    pre = post(pool.prefill, chat(url, max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
    got = post(pool.decode, chat(url, kv_transfer_params=pre["kv_transfer_params"]))

    assert tokens(got) == tokens(expected)
    assert got["choices"][0]["message"]["content"] == expected["choices"][0]["message"]["content"]
    assert rejected(pool.prefill, reason) - before == 1
    assert pool.prefill.metric("epdserve:encoder_runs_total") - runs0 == 1  # encoded itself
    assert not pool.raw.exists(key)
    for attempt in range(2):  # retries: the whole chain again, then P -> D alone
        again = (
            pool.run(url)
            if attempt == 0
            else post(pool.decode, chat(url, kv_transfer_params=pre["kv_transfer_params"]))
        )
        assert tokens(again) == tokens(expected)
    assert rejected(pool.prefill, reason) - before == 1
    assert [p.core_pid() for p in pool.pods] == cores
