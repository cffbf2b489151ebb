"""The engine core gets its config on stdin: a Redis URL's password in the KV-transfer
config never shows on a command line (``/proc/<pid>/cmdline``, ``ps``)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
import redis
from serving_support import API_KEY, ServerProcess

PASSWORD = "s3cret-in-url"


@pytest.fixture
def locked_redis(redis_server):
    """The session's redis-server, asking for ``PASSWORD`` during the test."""
    redis.Redis.from_url(redis_server.url).config_set("requirepass", PASSWORD)
    yield redis_server
    redis.Redis.from_url(redis_server.url, password=PASSWORD).config_set("requirepass", "")


def test_the_cores_command_line_holds_no_password(models, locked_redis):
    url = f"redis://:{PASSWORD}@127.0.0.1:{locked_redis.port}/0"
    config = {
        "kv_connector": "RedisConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"url": url},
    }
    # through the environment, as the operator passes it: neither command line holds it
    env = {"EPDSERVE_KV_TRANSFER_CONFIG": json.dumps(config)}
    pod = ServerProcess(str(models.get("llama")), "--hash-seed", "7", env=env)
    try:
        core_cmdline = Path(f"/proc/{pod.core_pid()}/cmdline").read_bytes()
        assert b"core_proc" in core_cmdline
        assert PASSWORD.encode() not in core_cmdline
        assert PASSWORD.encode() not in Path(f"/proc/{pod.proc.pid}/cmdline").read_bytes()
        body = {"model": "tiny", "prompt": "x = 1\n" * 20, "max_tokens": 2, "temperature": 0}
        auth = {"Authorization": f"Bearer {API_KEY}"}
        r = httpx.post(pod.url + "/v1/completions", json=body, headers=auth, timeout=60)
        assert r.status_code == 200, r.text
        store, deadline = redis.Redis.from_url(url), time.monotonic() + 30
        while not store.dbsize():  # saves finish after the answer
            assert time.monotonic() < deadline, "the core never reached the store"
            time.sleep(0.1)
        assert pod.metric("epdserve:kv_save_failures_total") == 0
    finally:
        pod.stop()
