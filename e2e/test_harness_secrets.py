"""The e2e kubelet runs the operator's KV-event pods as Kubernetes would (no root needed): the
pod IP from the downward API, and the Curve Secret projected with `items` into a per-pod
directory holding exactly the keys each side may see."""

from __future__ import annotations

import podspec
import pytest
from ipool_samples import pool_body

from epdserve.operator import cache, engine, kvevents, prompt_key, router
from epdserve.operator.spec import parse_pool

POOL = parse_pool(
    pool_body(
        "p",
        roles={"prefill": {}, "decode": {}},
        cache={"backend": "redis", "redis": {"managed": True}},
    )
)
KEYS = kvevents.new_curve_keys()
SECRET = kvevents.build_curve_secret(POOL, KEYS)
PROMPT_KEY = prompt_key.new_key()


OBJECTS = {
    (o["kind"], o["metadata"]["name"]): o
    for o in (
        SECRET,
        prompt_key.build_secret(POOL, PROMPT_KEY),
        cache.build_redis_secret(POOL, "pw"),
        engine.build_config_map(POOL),
    )
}


def no_token(pod, request):
    raise AssertionError("no ServiceAccount token expected")


def lookup(kind, namespace, name):
    return OBJECTS.get((kind, name))


def pod_from(deployment: dict, ip: str = "198.18.1.9") -> dict:
    template = deployment["spec"]["template"]
    meta = {"name": "p-1", "namespace": "ns", "uid": "u", **template["metadata"]}
    return {"metadata": meta, "spec": template["spec"], "status": {"podIP": ip}}


def curve_dir(pod: dict, tmp_path) -> dict[str, bytes]:
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == kvevents.CURVE_VOLUME]
    where = podspec.volume_source(pod, volume, lookup, tmp_path, no_token)
    assert where["readOnly"] is True
    return {p.name: p.read_bytes() for p in (tmp_path / "volumes" / volume["name"]).iterdir()}


def test_an_engine_pod_sees_its_ip_and_the_server_side_keys_only(tmp_path):
    pod = pod_from(engine.build_engine_deployment(POOL, "prefill"))
    container = pod["spec"]["containers"][0]
    env = podspec.container_env(pod, container, lookup, [], {})
    assert env["EPDSERVE_POD_IP"] == "198.18.1.9"
    assert env["EPDSERVE_KV_EVENTS_CURVE_DIR"] == kvevents.CURVE_DIR
    assert env[prompt_key.ENV] == PROMPT_KEY  # the pool's processed-prompt key, from its Secret
    files = curve_dir(pod, tmp_path)
    assert files == {k: KEYS[k] for k in ("server.public", "server.secret", "client.public")}


def test_a_router_pod_sees_the_client_side_keys_only(tmp_path):
    pod = pod_from(router.build_router_deployment(POOL))
    files = curve_dir(pod, tmp_path)
    assert files == {k: KEYS[k] for k in ("client.public", "client.secret", "server.public")}


def test_a_projected_key_missing_from_the_secret_stops_the_pod(tmp_path):
    pod = pod_from(router.build_router_deployment(POOL))
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == kvevents.CURVE_VOLUME]
    volume["secret"]["items"].append({"key": "absent", "path": "absent"})
    with pytest.raises(podspec.ConfigError, match="couldn't find key absent"):
        podspec.volume_source(pod, volume, lookup, tmp_path, no_token)
