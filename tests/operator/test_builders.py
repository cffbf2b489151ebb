"""Pure builders: the pod contract (commands, env, ports, probes), labels, owners, security."""

from __future__ import annotations

import base64
import json

from ipool_samples import example, pool_body

from epdserve.operator import cache, engine, router
from epdserve.operator.desired import desired_objects
from epdserve.operator.spec import parse_pool


def env_of(deployment: dict) -> dict:
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def container_of(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]["containers"][0]


def by_name(objects: list[dict]) -> dict:
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def test_colocated_pool_runs_serve_with_role_both():
    pool = parse_pool(example("colocated-text"))
    dep = engine.build_engine_deployment(pool, "colocated")
    assert container_of(dep)["command"] == [
        "epdserve", "serve", "Qwen/Qwen3-0.6B", "--role", "both", "--host", "0.0.0.0",
        "--port", "8000", "--served-model-name", "qwen3-0.6b",
    ]  # fmt: skip
    assert dep["metadata"]["name"] == "qwen-small-colocated"
    assert dep["spec"]["replicas"] == 2


def test_each_disaggregated_role_gets_its_serve_role_and_extra_args():
    body = example("epd-multimodal")
    body["spec"]["roles"]["decode"]["args"] = ["--max-num-seqs", "8"]
    pool = parse_pool(body)
    for role in ("encoder", "prefill", "decode"):
        command = container_of(engine.build_engine_deployment(pool, role))["command"]
        assert command[2:5] == ["/models/gemma-3-4b-it", "--role", role]
    decode = container_of(engine.build_engine_deployment(pool, "decode"))["command"]
    assert decode[-2:] == ["--max-num-seqs", "8"]


def test_engine_env_carries_pool_seed_events_topic_and_pod_ip_first():
    pool = parse_pool(example("pd-redis"))
    dep = engine.build_engine_deployment(pool, "prefill")
    names = [e["name"] for e in container_of(dep)["env"]]
    env = env_of(dep)
    assert names[0] == "POD_IP" and env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["EPDSERVE_POOL"] == "llama-pd"
    assert env["EPDSERVE_HASH_SEED"]["configMapKeyRef"]["key"] == "hash-seed"
    events = json.loads(env["EPDSERVE_KV_EVENTS_CONFIG"])
    assert events == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:5557",
        "replay_endpoint": "tcp://*:5558",
        "topic": "kv@$(POD_IP):8000@llama-3.1-8b-instruct",
    }
    assert env["EPDSERVE_BLOCK_SIZE"] == "16" and env["EPDSERVE_MAX_NUM_SEQS"] == "128"


def test_kv_roles_follow_the_pool_shape():
    pd = parse_pool(example("pd-redis"))
    assert engine.kv_transfer_config(pd, "prefill")["kv_role"] == "kv_producer"
    assert engine.kv_transfer_config(pd, "decode")["kv_role"] == "kv_consumer"
    assert engine.kv_transfer_config(pd, "decode") == {
        "kv_connector": "RedisConnector",
        "kv_role": "kv_consumer",
        "kv_connector_extra_config": {
            "url": "redis://llama-pd-redis.default.svc:6379/0",
            "pool": "llama-pd",  # stored blocks are keyed by pool
            "ttl_s": 3600,  # the default expiry of stored values
        },
    }
    # no encoder pods: the prefill pod stores the images it encodes for its decode pod
    assert engine.ec_transfer_config(pd, "prefill")["ec_role"] == "ec_both"
    assert engine.ec_transfer_config(pd, "decode")["ec_role"] == "ec_consumer"
    cached = parse_pool(
        pool_body(cache={"backend": "sharedStorage", "sharedStorage": {"claimName": "c"}})
    )
    assert engine.kv_transfer_config(cached, "colocated")["kv_role"] == "kv_both"
    assert engine.kv_transfer_config(parse_pool(pool_body()), "colocated") is None


def test_encoder_outputs_flow_from_encoder_to_prefill_and_decode():
    pool = parse_pool(example("epd-multimodal"))
    assert engine.ec_transfer_config(pool, "encoder") == {
        "ec_connector": "SharedStorageECConnector",
        "ec_role": "ec_producer",
        "ec_connector_extra_config": {
            "path": "/cache/ec",
            "pool": "gemma3-epd",
            "max_bytes": 45 << 30,  # a quarter of the example's 180Gi cap
        },
    }
    assert engine.ec_transfer_config(pool, "prefill")["ec_role"] == "ec_both"
    assert engine.ec_transfer_config(pool, "decode")["ec_role"] == "ec_consumer"
    assert engine.kv_transfer_config(pool, "encoder") is None
    encoder_env = env_of(engine.build_engine_deployment(pool, "encoder"))
    assert "EPDSERVE_KV_EVENTS_CONFIG" not in encoder_env  # encoders hold no KV cache
    config = engine.build_config_map(pool)["data"]
    assert json.loads(config["kv-transfer-prefill.json"])["kv_connector_extra_config"] == {
        "path": "/cache/kv",
        "pool": "gemma3-epd",
        "max_bytes": 135 << 30,  # the other three quarters
    }


def test_redis_password_comes_from_the_referenced_or_generated_secret():
    external = pool_body(
        roles={"prefill": {}, "decode": {}},
        cache={
            "backend": "redis",
            "redis": {"url": "redis://r:6379/0", "passwordSecretRef": {"name": "rs", "key": "pw"}},
        },
    )
    env = env_of(engine.build_engine_deployment(parse_pool(external), "decode"))
    assert env["EPDSERVE_REDIS_PASSWORD"] == {"secretKeyRef": {"name": "rs", "key": "pw"}}
    managed = parse_pool(example("pd-redis"))
    env = env_of(engine.build_engine_deployment(managed, "decode"))
    assert env["EPDSERVE_REDIS_PASSWORD"] == {
        "secretKeyRef": {"name": "llama-pd-redis", "key": "password"}
    }
    secret = cache.build_redis_secret(managed, "s3cret")
    assert base64.b64decode(secret["data"]["password"]) == b"s3cret"


def test_user_env_comes_last_so_it_wins():
    pool = parse_pool(example("epd-multimodal"))
    env = container_of(engine.build_engine_deployment(pool, "decode"))["env"]
    assert env[-1] == {"name": "EPDSERVE_MAX_NUM_SEQS", "value": "64"}


def test_engine_pods_are_locked_down_and_probed():
    pool = parse_pool(example("pd-redis"))
    for obj in desired_objects(pool):
        if obj["kind"] != "Deployment":
            continue
        pod = obj["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"] == {"drop": ["ALL"]}
    dep = engine.build_engine_deployment(pool, "decode")
    c = container_of(dep)
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts["/models"]["readOnly"] is True and "/tmp" in mounts
    assert {p["containerPort"] for p in c["ports"]} == {8000, 5557, 5558}


def test_labels_selectors_and_owner_references():
    pool = parse_pool(example("pd-redis"))
    for obj in desired_objects(pool):
        meta = obj["metadata"]
        assert meta["labels"]["epdserve.io/pool"] == "llama-pd", obj["kind"]
        (owner,) = meta["ownerReferences"]
        assert owner["uid"] == "0000-uid" and owner["controller"] is True
    dep = engine.build_engine_deployment(pool, "prefill")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert labels["epdserve.io/pool"] == "llama-pd" and labels["epdserve.io/role"] == "prefill"
    svc = engine.build_role_service(pool, "prefill")
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]


def test_router_discovers_engine_pods_but_not_itself():
    pool = parse_pool(example("pd-redis"))
    dep = router.build_router_deployment(pool)
    command = container_of(dep)["command"]
    assert command[:2] == ["epdserve", "router"]
    flags = dict(zip(command[2::2], command[3::2], strict=True))
    assert flags["--selector"] == "epdserve.io/pool=llama-pd"
    assert flags["--strategy"] == "prefix+load" and flags["--namespace"] == "default"
    assert flags["--model"] == "/models/llama-3.1-8b-instruct"
    assert "epdserve.io/pool" not in dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == "llama-pd-router"
    svc = router.build_router_service(pool)
    assert svc["metadata"]["name"] == "llama-pd" and svc["spec"]["type"] == "ClusterIP"
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    assert router.endpoint_url(pool) == "http://llama-pd.default.svc:80"


def test_router_role_is_namespaced_read_only_on_pods_and_endpointslices():
    role = router.build_router_role(parse_pool(example("pd-redis")))
    assert role["kind"] == "Role"
    resources = {r for rule in role["rules"] for r in rule["resources"]}
    verbs = {v for rule in role["rules"] for v in rule["verbs"]}
    assert resources == {"pods", "endpointslices"} and verbs == {"get", "list", "watch"}


def test_managed_redis_runs_without_persistence_behind_its_service():
    pool = parse_pool(example("pd-redis"))
    objects = by_name(desired_objects(pool))
    dep = objects["Deployment", "llama-pd-redis"]
    assert '--save "" --appendonly no' in container_of(dep)["args"][0]
    assert objects["Service", "llama-pd-redis"]["spec"]["ports"][0]["port"] == 6379
    assert ("ServiceMonitor", "llama-pd-metrics") in objects


def test_a_config_change_rolls_the_engine_pods():
    body = example("pd-redis")
    before = by_name(desired_objects(parse_pool(body)))["Deployment", "llama-pd-decode"]
    body["spec"]["hashSeed"] = "another-seed"
    after = by_name(desired_objects(parse_pool(body)))["Deployment", "llama-pd-decode"]
    key = "epdserve.io/config-hash"
    assert (
        before["spec"]["template"]["metadata"]["annotations"][key]
        != (after["spec"]["template"]["metadata"]["annotations"][key])
    )


def test_builders_are_deterministic():
    body = example("epd-multimodal")
    assert desired_objects(parse_pool(body)) == desired_objects(parse_pool(body))


def test_engine_pods_are_told_their_cpu_limit_else_request_rounded_down():
    body = example("pd-redis")
    body["spec"]["roles"]["prefill"]["resources"] = {"limits": {"cpu": "8"}}
    body["spec"]["roles"]["decode"]["resources"] = {"requests": {"cpu": "1500m"}}
    pool = parse_pool(body)
    assert env_of(engine.build_engine_deployment(pool, "prefill"))["EPDSERVE_CPUS"] == "8"
    assert env_of(engine.build_engine_deployment(pool, "decode"))["EPDSERVE_CPUS"] == "1"
    assert "OMP_NUM_THREADS" not in env_of(engine.build_engine_deployment(pool, "prefill"))
    body["spec"]["roles"]["prefill"]["env"] = [{"name": "EPDSERVE_CPUS", "value": "3"}]
    names = [
        e["name"]
        for e in container_of(engine.build_engine_deployment(parse_pool(body), "prefill"))["env"]
    ]
    assert names.count("EPDSERVE_CPUS") == 1  # the user's own setting, not ours
