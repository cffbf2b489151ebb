"""Cluster secrets and the KV-event sockets on the operator side (pure builders): the pod IP
and Curve keys each pod gets, the generated Secrets, and no secret outside a Secret."""

from __future__ import annotations

import base64
import json

import jsonschema
import pytest
import yaml
import zmq
from ipool_samples import ROOT, example, pool_body

from epdserve.operator import cache, engine, kvevents, prompt_key, router
from epdserve.operator.desired import desired_objects, generated_secrets
from epdserve.operator.spec import InvalidSpec, parse_pool

PD = {"prefill": {}, "decode": {}}
EPD = {"encoder": {}, "prefill": {}, "decode": {}}
MANAGED = {"backend": "redis", "redis": {"managed": True}}
CRD = yaml.safe_load((ROOT / "crds" / "inferencepool.yaml").read_text())
SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
CURVE_DIR = "/etc/epdserve/kv-events-curve"


def pod_of(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]


def container_of(deployment: dict) -> dict:
    return pod_of(deployment)["containers"][0]


def env_of(deployment: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container_of(deployment)["env"]}


def curve_volume(deployment: dict) -> dict | None:
    vols = [v for v in pod_of(deployment)["volumes"] if v["name"] == "kv-events-curve"]
    return vols[0] if vols else None


def curve_mounts(deployment: dict) -> list[dict]:
    mounts = container_of(deployment)["volumeMounts"]
    return [m for m in mounts if m["name"] == "kv-events-curve"]


def test_every_engine_pod_gets_its_ip_from_the_downward_api():
    pool = parse_pool(pool_body(roles=EPD, cache=MANAGED))
    for role in EPD:
        env = env_of(engine.build_engine_deployment(pool, role))
        assert env["EPDSERVE_POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}


def test_publishing_engines_mount_the_server_pair_and_the_client_public_key():
    pool = parse_pool(pool_body(roles=EPD, cache=MANAGED))
    for role in ("prefill", "decode"):
        dep = engine.build_engine_deployment(pool, role)
        assert env_of(dep)["EPDSERVE_KV_EVENTS_CURVE_DIR"] == CURVE_DIR
        assert curve_volume(dep)["secret"] == {
            "secretName": "p-kv-events-curve",
            "items": [
                {"key": "server.public", "path": "server.public"},
                {"key": "server.secret", "path": "server.secret"},
                {"key": "client.public", "path": "client.public"},
            ],
        }
        assert curve_mounts(dep) == [
            {"name": "kv-events-curve", "mountPath": CURVE_DIR, "readOnly": True}
        ]


def test_encoder_pods_publish_no_events_and_hold_no_curve_keys():
    pool = parse_pool(pool_body(roles=EPD, cache=MANAGED))
    dep = engine.build_engine_deployment(pool, "encoder")
    assert "EPDSERVE_KV_EVENTS_CURVE_DIR" not in env_of(dep)
    assert curve_volume(dep) is None and curve_mounts(dep) == []


def test_the_router_mounts_the_client_pair_and_the_server_public_key():
    pool = parse_pool(pool_body(roles=PD, cache=MANAGED))
    dep = router.build_router_deployment(pool)
    items = curve_volume(dep)["secret"]["items"]
    assert [i["key"] for i in items] == ["client.public", "client.secret", "server.public"]
    assert curve_mounts(dep) == [
        {"name": "kv-events-curve", "mountPath": CURVE_DIR, "readOnly": True}
    ]
    command = container_of(dep)["command"]
    assert command[command.index("--kv-events-curve-dir") + 1] == CURVE_DIR


@pytest.mark.parametrize(
    "kv_events", [{"curve": False}, {"enabled": False}, {"enabled": False, "curve": True}]
)
def test_without_curve_no_pod_mounts_keys_and_no_key_secret_is_made(kv_events):
    pool = parse_pool(pool_body(roles=PD, cache=MANAGED, kvEvents=kv_events))
    deployments = [o for o in desired_objects(pool) if o["kind"] == "Deployment"]
    for dep in deployments:
        assert curve_volume(dep) is None
        assert "EPDSERVE_KV_EVENTS_CURVE_DIR" not in env_of(dep)
        assert "--kv-events-curve-dir" not in container_of(dep)["command"]
    assert [name for name, _ in generated_secrets(pool)] == ["p-redis", "p-processed-prompt-key"]


def test_curve_is_on_by_default():
    assert parse_pool(pool_body()).kv_events_curve is True


def test_the_curve_secret_holds_two_z85_key_pairs_and_is_owned_by_the_pool():
    pool = parse_pool(pool_body(roles=PD, cache=MANAGED))
    secret = kvevents.build_curve_secret(pool, kvevents.new_curve_keys())
    assert secret["metadata"]["name"] == "p-kv-events-curve"
    (owner,) = secret["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["uid"], owner["controller"]) == ("InferencePool", "uid-1", True)
    keys = {k: base64.b64decode(v) for k, v in secret["data"].items()}
    assert sorted(keys) == ["client.public", "client.secret", "server.public", "server.secret"]
    assert all(len(k) == 40 for k in keys.values())  # Z85 text of 32-byte keys, no newline
    for side in ("server", "client"):
        assert zmq.curve_public(keys[f"{side}.secret"]) == keys[f"{side}.public"]
    assert keys["server.public"] != keys["client.public"]


def test_each_generated_secret_draws_fresh_keys():
    pool = parse_pool(pool_body())
    names = []
    for name, build in generated_secrets(pool):
        names.append(name)
        assert build()["data"] != build()["data"]
    assert names == ["p-kv-events-curve", "p-processed-prompt-key"]


def test_generated_secrets_follow_the_pool():
    assert [n for n, _ in generated_secrets(parse_pool(example("pd-redis")))] == [
        "llama-pd-redis",
        "llama-pd-kv-events-curve",
        "llama-pd-processed-prompt-key",
    ]


@pytest.mark.parametrize(
    "url",
    [
        "redis://:hunter2@r.cache:6379/0",
        "redis://app:hunter2@r.cache:6379/0",
        "rediss://r.cache:6379/0?password=hunter2",
        "redis://r.cache:6379/0?ssl_cert_reqs=none&PASSWORD=hunter2",
    ],
)
def test_a_password_in_the_redis_url_is_an_invalid_spec_pointing_at_the_secret_field(url):
    body = pool_body(roles=PD, cache={"backend": "redis", "redis": {"url": url}})
    with pytest.raises(InvalidSpec, match=r"spec\.cache\.redis\.url.*passwordSecretRef"):
        parse_pool(body)


def test_a_redis_user_name_without_a_password_is_accepted():
    redis = {"url": "redis://app@r.cache:6379/0", "passwordSecretRef": {"name": "rs"}}
    pool = parse_pool(pool_body(roles=PD, cache={"backend": "redis", "redis": redis}))
    assert pool.cache.redis_url == "redis://app@r.cache:6379/0"


def _strings(value):
    """Every string in a manifest (keys and values, at any depth)."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield str(k)
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)
    elif isinstance(value, str):
        yield value


SENSITIVE = ("PASSWORD", "TOKEN", "API_KEY", "SECRET")


@pytest.mark.parametrize("cache_spec", [MANAGED, "external"], ids=["managed", "external"])
def test_no_secret_value_reaches_any_object_but_its_secret(cache_spec, monkeypatch):
    password, keys = "pw-5e1b0c2f-never-elsewhere", kvevents.new_curve_keys()
    signing = "pk-0c4f9a7e-never-elsewhere"
    monkeypatch.setattr(cache, "new_password", lambda: password)
    monkeypatch.setattr(kvevents, "new_curve_keys", lambda: keys)
    monkeypatch.setattr(prompt_key, "new_key", lambda: signing)
    if cache_spec == "external":  # with a user name: it stays in the URL, the password not
        redis = {"url": "redis://app@r.cache:6379/0", "passwordSecretRef": {"name": "rs"}}
        cache_spec = {"backend": "redis", "redis": redis}
    hub = {"id": "org/model", "tokenSecretRef": {"name": "hub"}}
    body = pool_body(
        roles=EPD,
        cache=cache_spec,
        model={"name": "m", "source": {"huggingFace": hub}},
        router={"apiKeySecretRef": {"name": "keys"}},
    )
    pool = parse_pool(body)
    secrets = [build() for _, build in generated_secrets(pool)]
    secret_text = json.dumps(secrets)
    values = [k.decode() for k in keys.values()] + [signing]
    if cache_spec is MANAGED:  # an external server's password is never known to the operator
        values.append(password)
    assert all(base64.b64encode(v.encode()).decode() in secret_text for v in values)
    for obj in desired_objects(pool):
        text = "\n".join(_strings(obj))
        for value in values:
            assert value not in text, (obj["kind"], obj["metadata"]["name"])
            assert base64.b64encode(value.encode()).decode() not in text
        for container in _containers(obj):
            for var in container.get("env") or []:
                if any(word in var["name"] for word in SENSITIVE):
                    assert "secretKeyRef" in var["valueFrom"], var  # never a literal value


def _containers(obj: dict) -> list[dict]:
    if obj["kind"] != "Deployment":
        return []
    spec = pod_of(obj)
    return spec["containers"] + (spec.get("initContainers") or [])


@pytest.mark.parametrize("curve", [True, False, "yes"])
def test_the_crd_takes_kv_events_curve_as_a_boolean(curve):
    body = pool_body(kvEvents={"enabled": True, "curve": curve})
    body["metadata"] = {"name": "p"}
    validator = jsonschema.Draft7Validator(SCHEMA)
    if isinstance(curve, bool):
        validator.validate(body)
    else:
        with pytest.raises(jsonschema.ValidationError, match="is not of type 'boolean'"):
            validator.validate(body)


@pytest.mark.parametrize(
    ("url", "ok"),
    [
        ("redis://r.cache:6379/0", True),
        ("redis://app@r.cache:6379/0", True),
        ("rediss://[::1]:6380", True),
        ("redis://:hunter2@r.cache:6379/0", False),
        ("redis://app:hunter2@r.cache:6379/0", False),
    ],
)
def test_the_crd_refuses_a_redis_url_with_a_password(url, ok):
    body = pool_body(roles=PD, cache={"backend": "redis", "redis": {"url": url}})
    body["metadata"] = {"name": "p"}
    validator = jsonschema.Draft7Validator(SCHEMA)
    if ok:
        validator.validate(body)
    else:
        with pytest.raises(jsonschema.ValidationError, match="does not match"):
            validator.validate(body)
