"""parse_pool: defaults, derived values, and the combinations the schema cannot express."""

from __future__ import annotations

import pytest
from ipool_samples import example, pool_body

from epdserve.operator.spec import InvalidSpec, parse_pool

REDIS = {"backend": "redis", "redis": {"managed": True}}


def test_defaults_fill_a_minimal_colocated_pool():
    pool = parse_pool(pool_body())
    assert pool.roles["colocated"].replicas == 1
    assert pool.cache.backend == "none"
    assert pool.kv_events is True
    assert pool.router.strategy == "prefix+load" and pool.router.service_port == 80
    assert pool.hash_seed == "uid-1"  # the pool's UID when hashSeed is not set
    assert pool.service_monitor is None


@pytest.mark.parametrize(
    ("given", "flag"),
    [("4GiB", 4 << 30), ("512Mi", 512 << 20), ("1GB", 10**9), ("16777216", 16 << 20)],
)
def test_kv_cache_memory_reaches_the_engine_in_bytes(given, flag):
    body = pool_body(engine={"image": "img:1", "kvCacheMemory": given})
    assert parse_pool(body).tuning["KV_CACHE_MEMORY"] == flag


def test_a_kv_cache_memory_that_is_no_size_names_the_field():
    with pytest.raises(InvalidSpec, match=r"spec\.engine\.kvCacheMemory"):
        parse_pool(pool_body(engine={"image": "img:1", "kvCacheMemory": "lots"}))


@pytest.mark.parametrize(
    ("source", "model_arg"),
    [
        ({"pvc": {"claimName": "w", "path": "llama/8b/"}}, "/models/llama/8b"),
        ({"pvc": {"claimName": "w"}}, "/models"),
        ({"path": "/opt/model"}, "/opt/model"),
        ({"huggingFace": {"id": "Qwen/Qwen3-0.6B"}}, "Qwen/Qwen3-0.6B"),
    ],
)
def test_model_argument_follows_the_source(source, model_arg):
    body = pool_body()
    body["spec"]["model"]["source"] = source
    assert parse_pool(body).model_arg == model_arg


@pytest.mark.parametrize(
    ("roles", "cache", "field"),
    [
        ({}, None, "spec.roles"),
        ({"prefill": {}}, REDIS, "needs decode"),
        ({"decode": {}}, REDIS, "needs prefill"),
        ({"encoder": {}}, REDIS, "needs decode and prefill"),
        ({"colocated": {}, "decode": {}}, REDIS, "colocated cannot be combined with decode"),
        ({"prefill": {}, "decode": {}}, None, "spec.cache.backend"),
        ({"prefill": {}, "decode": {}}, {"backend": "redis", "redis": {}}, "spec.cache.redis"),
        (
            {"colocated": {}},
            {"backend": "redis", "redis": {"managed": True, "url": "redis://r:6379/0"}},
            "exactly one of url or managed",
        ),
        (
            {"colocated": {}},
            {"backend": "redis", "redis": {"managed": True, "passwordSecretRef": {"name": "s"}}},
            "passwordSecretRef",
        ),
        ({"colocated": {}}, {"backend": "sharedStorage"}, "sharedStorage.claimName"),
    ],
)
def test_invalid_combinations_raise_naming_the_field(roles, cache, field):
    body = pool_body(cache=cache)
    body["spec"]["roles"] = roles
    with pytest.raises(InvalidSpec, match=field):
        parse_pool(body)


def test_two_model_sources_are_invalid():
    body = pool_body()
    body["spec"]["model"]["source"] = {"path": "/m", "huggingFace": {"id": "a/b"}}
    with pytest.raises(InvalidSpec, match="exactly one of pvc, path, huggingFace"):
        parse_pool(body)


def test_every_example_is_a_valid_pool():
    for name, roles in [
        ("colocated-text", {"colocated"}),
        ("pd-redis", {"prefill", "decode"}),
        ("epd-multimodal", {"encoder", "prefill", "decode"}),
    ]:
        assert set(parse_pool(example(name)).roles) == roles
