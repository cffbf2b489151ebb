"""Bounded stores, NetworkPolicies and the router API key: spec parsing and pure builders."""

from __future__ import annotations

import json

import pytest
from ipool_samples import example, pool_body

from epdserve.operator import cache, engine, network, router
from epdserve.operator.desired import desired_objects
from epdserve.operator.quantity import parse_bytes
from epdserve.operator.spec import InvalidSpec, parse_pool

PD = {"prefill": {}, "decode": {}}
EPD = {"encoder": {}, "prefill": {}, "decode": {}}


def managed(**redis) -> dict:
    return {"backend": "redis", "redis": {"managed": True, **redis}}


def shared(**storage) -> dict:
    return {"backend": "sharedStorage", "sharedStorage": {"claimName": "c", **storage}}


def redis_args(body: dict) -> str:
    dep = cache.build_redis_deployment(parse_pool(body))
    return dep["spec"]["template"]["spec"]["containers"][0]["args"][0]


def env_of(deployment: dict) -> dict:
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


@pytest.mark.parametrize(
    ("text", "size"),
    [("512Mi", 512 << 20), ("2G", 2 * 10**9), ("1e3", 1000), (4096, 4096), ("1.5Ki", 1536)],
)
def test_quantities_parse_as_kubernetes_reads_them(text, size):
    assert parse_bytes(text) == size


@pytest.mark.parametrize(
    ("redis", "maxmemory"),
    [
        ({"resources": {"limits": {"memory": "1Gi"}}}, int(0.8 * 2**30)),
        ({"resources": {"limits": {"memory": "1Gi"}}, "maxMemory": "512Mi"}, 512 << 20),
        ({}, 2**30),  # no limit to derive it from
    ],
    ids=["80% of the limit", "explicit", "fixed default"],
)
def test_managed_redis_is_capped_and_evicts_least_recently_used_keys(redis, maxmemory):
    args = redis_args(pool_body(roles=PD, cache=managed(**redis)))
    assert f"--maxmemory {maxmemory} --maxmemory-policy allkeys-lru" in args
    assert "requirepass" in args and '"$REDIS_PASSWORD"' in args  # from the env, on stdin


def test_redis_keys_expire_after_the_spec_ttl_in_both_connectors():
    pool = parse_pool(pool_body(roles=EPD, cache=managed(ttlSeconds=600)))
    assert engine.kv_transfer_config(pool, "decode")["kv_connector_extra_config"]["ttl_s"] == 600
    assert engine.ec_transfer_config(pool, "encoder")["ec_connector_extra_config"]["ttl_s"] == 600


def test_a_zero_ttl_means_no_expiry():
    pool = parse_pool(pool_body(roles=PD, cache=managed(ttlSeconds=0)))
    assert "ttl_s" not in engine.kv_transfer_config(pool, "prefill")["kv_connector_extra_config"]


def test_the_shared_volume_cap_is_split_three_to_one_with_encoder_outputs():
    pool = parse_pool(pool_body(roles=EPD, cache=shared(maxBytes="4Gi")))
    kv = engine.kv_transfer_config(pool, "prefill")["kv_connector_extra_config"]
    ec = engine.ec_transfer_config(pool, "encoder")["ec_connector_extra_config"]
    assert (kv["max_bytes"], ec["max_bytes"]) == (3 << 30, 1 << 30)
    assert (kv["path"], ec["path"]) == ("/cache/kv", "/cache/ec")


def test_without_encoders_kv_blocks_get_fifteen_sixteenths_of_the_volume_cap():
    pool = parse_pool(pool_body(roles=PD, cache=shared(maxBytes="16G")))
    kv = engine.kv_transfer_config(pool, "decode")["kv_connector_extra_config"]
    ec = engine.ec_transfer_config(pool, "prefill")["ec_connector_extra_config"]
    assert (kv["max_bytes"], ec["max_bytes"]) == (15 * 10**9, 10**9)


@pytest.mark.parametrize(
    ("cache_spec", "field", "values"),
    [
        (managed(ttlSeconds=60), "ttl_s", [60, 60]),
        (shared(maxBytes="1Gi"), "max_bytes", [3 << 28, 1 << 28]),
    ],
    ids=["redis", "shared-storage"],
)
def test_the_connectors_accept_the_bounded_configs_the_operator_writes(cache_spec, field, values):
    from epdserve.connectors.ec_connector.config import ECTransferConfig
    from epdserve.connectors.kv_connector.config import KVTransferConfig
    from epdserve.connectors.storage import store_config

    data = engine.build_config_map(parse_pool(pool_body(roles=EPD, cache=cache_spec)))["data"]
    kv = KVTransferConfig.parse(data["kv-transfer-prefill.json"])
    ec = ECTransferConfig.parse(data["ec-transfer-encoder.json"])
    options = [kv.storage_options(), ec.storage_options()]
    assert [getattr(store_config(o), field) for o in options] == values


@pytest.mark.parametrize(
    ("cache_spec", "field"),
    [
        (managed(maxMemory="lots"), "spec.cache.redis.maxMemory: not a quantity"),
        (managed(maxMemory="0"), "spec.cache.redis.maxMemory: must be more than 0"),
        (
            managed(maxMemory="2Gi", resources={"limits": {"memory": "1Gi"}}),
            "exceeds the Redis container's memory limit",
        ),
        (
            {"backend": "redis", "redis": {"url": "redis://r:6379/0", "maxMemory": "1Gi"}},
            "applies to the managed Redis only",
        ),
        (managed(ttlSeconds=-1), "spec.cache.redis.ttlSeconds"),
        (shared(maxBytes="-5Gi"), "spec.cache.sharedStorage.maxBytes"),
    ],
)
def test_bad_store_bounds_are_invalid_specs_naming_the_field(cache_spec, field):
    with pytest.raises(InvalidSpec, match=field):
        parse_pool(pool_body(roles=PD, cache=cache_spec))


def test_engine_event_ports_admit_the_pools_routers_only_and_http_anyone():
    pool = parse_pool(example("pd-redis"))
    spec = network.build_engine_network_policy(pool)["spec"]
    assert spec["podSelector"] == {"matchLabels": {"epdserve.io/pool": "llama-pd"}}
    assert spec["policyTypes"] == ["Ingress"]
    http, events = spec["ingress"]
    assert http == {"ports": [{"protocol": "TCP", "port": 8000}]}  # no `from`: anyone
    assert [p["port"] for p in events["ports"]] == [5557, 5558]
    # the router is the only subscriber: engine pods do not reach each other's event ports
    assert events["from"] == [{"podSelector": {"matchLabels": {"epdserve.io/router": "llama-pd"}}}]


def test_the_managed_redis_admits_the_pools_engines_only():
    pool = parse_pool(example("pd-redis"))
    spec = network.build_redis_network_policy(pool)["spec"]
    assert spec["podSelector"] == {"matchLabels": {"epdserve.io/redis": "llama-pd"}}
    (rule,) = spec["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 6379}]
    assert rule["from"] == [{"podSelector": {"matchLabels": {"epdserve.io/pool": "llama-pd"}}}]


def test_the_policies_select_the_pods_the_builders_label():
    pool = parse_pool(example("pd-redis"))
    engine_pod = engine.build_engine_deployment(pool, "decode")["spec"]["template"]["metadata"]
    redis_pod = cache.build_redis_deployment(pool)["spec"]["template"]["metadata"]
    router_pod = router.build_router_deployment(pool)["spec"]["template"]["metadata"]
    engines, redis = network.build_network_policies(pool)

    def selects(policy, pod) -> bool:
        wanted = policy["spec"]["podSelector"]["matchLabels"]
        return wanted.items() <= pod["labels"].items()

    assert selects(engines, engine_pod) and not selects(engines, router_pod)
    assert selects(redis, redis_pod) and not selects(engines, redis_pod)
    peers = [p["podSelector"]["matchLabels"] for p in engines["spec"]["ingress"][1]["from"]]
    assert any(p.items() <= router_pod["labels"].items() for p in peers)
    assert not any(p.items() <= engine_pod["labels"].items() for p in peers)


def test_without_kv_events_only_http_reaches_the_engines():
    pool = parse_pool(pool_body(kvEvents={"enabled": False}))
    (policy,) = network.build_network_policies(pool)
    assert policy["spec"]["ingress"] == [{"ports": [{"protocol": "TCP", "port": 8000}]}]


def test_network_policies_can_be_switched_off():
    pool = parse_pool(pool_body(roles=PD, cache=managed(), networkPolicy={"enabled": False}))
    assert not [o for o in desired_objects(pool) if o["kind"] == "NetworkPolicy"]


def test_the_api_key_secret_reaches_the_router_and_every_engine():
    body = pool_body(roles=EPD, cache=managed(), router={"apiKeySecretRef": {"name": "keys"}})
    pool = parse_pool(body)
    ref = {"secretKeyRef": {"name": "keys", "key": "api-key"}}
    assert env_of(router.build_router_deployment(pool))["EPDSERVE_API_KEY"] == ref
    for role in EPD:
        assert env_of(engine.build_engine_deployment(pool, role))["EPDSERVE_API_KEY"] == ref
    assert "api-key" not in json.dumps(engine.build_config_map(pool))  # never in plain text


def test_without_an_api_key_no_pod_gets_one():
    pool = parse_pool(pool_body(roles=PD, cache=managed()))
    deployments = [o for o in desired_objects(pool) if o["kind"] == "Deployment"]
    assert all("EPDSERVE_API_KEY" not in env_of(d) for d in deployments)


def test_an_api_key_reference_without_a_name_is_an_invalid_spec():
    with pytest.raises(InvalidSpec, match="spec.router.apiKeySecretRef.name"):
        parse_pool(pool_body(router={"apiKeySecretRef": {"key": "k"}}))
