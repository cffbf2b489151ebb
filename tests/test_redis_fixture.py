"""The tests' redis-server is a real server process."""

import redis


def test_redis_fixture_is_a_real_server_that_stores_values(redis_url, redis_server):
    client = redis.Redis.from_url(redis_url)
    client.set("k", b"\x00\x01" * 1000)
    assert client.get("k") == b"\x00\x01" * 1000
    assert client.info("server")["tcp_port"] == redis_server.port
