"""The pool's processed-prompt key on the operator side (pure builders): one generated Secret
per pool, and every engine and router pod reads it from there under the variable that
`epdserve serve` and `epdserve router` take."""

from __future__ import annotations

import base64
import re

import pytest
from ipool_samples import pool_body

from epdserve.common.cli_fields import env_name
from epdserve.operator import prompt_key
from epdserve.operator.desired import desired_objects, generated_secrets
from epdserve.operator.spec import parse_pool

EPD = {"encoder": {}, "prefill": {}, "decode": {}}
MANAGED = {"backend": "redis", "redis": {"managed": True}}
REF = {"secretKeyRef": {"name": "p-processed-prompt-key", "key": "key"}}


def env_items(deployment: dict) -> dict:
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e for e in container["env"]}


@pytest.mark.parametrize("roles", [EPD, {"colocated": {}}], ids=["epd", "colocated"])
def test_every_engine_and_router_pod_reads_the_key_from_the_pools_secret(roles):
    pool = parse_pool(pool_body(roles=roles, cache=MANAGED))
    deployments = [o for o in desired_objects(pool) if o["kind"] == "Deployment"]
    names = {d["metadata"]["name"] for d in deployments}
    assert names == {f"p-{role}" for role in roles} | {"p-router", "p-redis"}
    deployments = [d for d in deployments if d["metadata"]["name"] != "p-redis"]
    for deployment in deployments:
        item = env_items(deployment)["EPDSERVE_PROCESSED_PROMPT_KEY"]
        assert item == {"name": "EPDSERVE_PROCESSED_PROMPT_KEY", "valueFrom": REF}


def test_the_key_secret_holds_a_random_256_bit_key_and_is_owned_by_the_pool():
    pool = parse_pool(pool_body(roles=EPD, cache=MANAGED))
    builds = dict(generated_secrets(pool))
    secret = builds["p-processed-prompt-key"]()
    (owner,) = secret["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["uid"], owner["controller"]) == ("InferencePool", "uid-1", True)
    key = base64.b64decode(secret["data"]["key"]).decode()
    assert re.fullmatch(r"[0-9a-f]{64}", key)
    assert base64.b64decode(builds["p-processed-prompt-key"]()["data"]["key"]).decode() != key


def test_the_variable_is_the_one_serve_and_router_read():
    from epdserve.engine.entrypoints.serve_cli import ServeOptions
    from epdserve.router.config import RouterConfig

    for config in (ServeOptions, RouterConfig):
        assert "processed_prompt_key" in config.__dataclass_fields__
    assert env_name("processed_prompt_key") == prompt_key.ENV
