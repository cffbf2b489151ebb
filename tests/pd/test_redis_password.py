"""``EPDSERVE_REDIS_PASSWORD`` reaches a RedisConnector whose URL carries no password."""

from __future__ import annotations

import redis

from epdserve.connectors.kv_connector import (
    KVConnectorRole,
    KVLayout,
    KVTransferConfig,
    RedisConnector,
)

LAYOUT = KVLayout("fp-test", 4, "sha256_cbor", 2)


def test_the_password_comes_from_the_environment(redis_url, monkeypatch):
    client = redis.Redis.from_url(redis_url)
    client.config_set("requirepass", "s3cret")
    try:
        config = KVTransferConfig("RedisConnector", "kv_both", {"url": redis_url})
        monkeypatch.setenv("EPDSERVE_REDIS_PASSWORD", "s3cret")
        with_password = RedisConnector(config, KVConnectorRole.SCHEDULER, LAYOUT)
        monkeypatch.delenv("EPDSERVE_REDIS_PASSWORD")
        without = RedisConnector(config, KVConnectorRole.SCHEDULER, LAYOUT)
        assert with_password.store.put_many([("k", b"v")]) == [True]
        assert without.store.put_many([("k", b"v")]) == [False]
        with_password.close()
        without.close()
    finally:
        redis.Redis.from_url(redis_url, password="s3cret").config_set("requirepass", "")
