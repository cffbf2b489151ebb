"""`spec.router.tenancy`: the schema, the field-path errors, and the router Deployment that
mounts the tenants Secret and passes the router's tenant flags."""

from __future__ import annotations

import argparse

import jsonschema
import kubernetes_validate
import pytest
import yaml
from ipool_samples import ROOT, pool_body

from epdserve.operator.errors import InvalidSpec
from epdserve.operator.router import build_router_deployment
from epdserve.operator.spec import parse_pool
from epdserve.router import cli

CRD = yaml.safe_load((ROOT / "crds" / "inferencepool.yaml").read_text())
SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
TENANCY = {
    "keysSecretRef": {"name": "tenants"},
    "header": "X-Tenant-Id",
    "maxInflightPerPod": 6,
    "reservePerPod": 2,
    "queueTimeoutSeconds": 5,
}


def router_container(tenancy: dict | None) -> tuple[dict, dict]:
    router = {"tenancy": tenancy} if tenancy is not None else {}
    deployment = build_router_deployment(parse_pool(pool_body(router=router)))
    pod = deployment["spec"]["template"]["spec"]
    return pod, pod["containers"][0]


def test_the_tenants_secret_is_mounted_read_only_and_passed_as_tenant_keys():
    body = pool_body(router={"tenancy": TENANCY})
    jsonschema.Draft7Validator(SCHEMA).validate(body)
    pod, container = router_container(TENANCY)
    volume = next(v for v in pod["volumes"] if v["name"] == "tenant-keys")
    assert volume["secret"]["secretName"] == "tenants"
    assert volume["secret"]["items"] == [{"key": "tenants.yaml", "path": "tenants.yaml"}]
    mount = next(m for m in container["volumeMounts"] if m["name"] == "tenant-keys")
    assert mount["readOnly"] is True
    command = container["command"]
    path = command[command.index("--tenant-keys") + 1]
    assert path == mount["mountPath"] + "/tenants.yaml"
    kubernetes_validate.validate(build_router_deployment(parse_pool(body)), "1.33.0", strict=True)


def test_the_router_accepts_every_flag_the_operator_passes():
    _, container = router_container({**TENANCY, "priority": True})
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(container["command"][2:])
    assert (args.tenant_header, args.max_inflight_per_pod) == ("X-Tenant-Id", 6)
    assert (args.tenant_reserve_per_pod, args.tenant_queue_timeout) == (2, 5.0)
    assert args.tenant_priority is True


def test_without_tenancy_the_router_gets_no_tenant_flag_or_volume():
    pod, container = router_container(None)
    assert not [a for a in container["command"] if "tenant" in a or "inflight" in a]
    assert all(v["name"] != "tenant-keys" for v in pod["volumes"])


@pytest.mark.parametrize(
    ("tenancy", "field"),
    [
        ({"keysSecretRef": {"key": "x"}}, "spec.router.tenancy.keysSecretRef.name"),
        ({"maxInflightPerPod": -1}, "spec.router.tenancy.maxInflightPerPod"),
        ({"queueSize": 0}, "spec.router.tenancy.queueSize"),
        ({"queueTimeoutSeconds": 0}, "spec.router.tenancy.queueTimeoutSeconds"),
        ({"header": "Authorization"}, "spec.router.tenancy.header"),
        ({"header": "X Tenant"}, "spec.router.tenancy.header"),
    ],
)
def test_a_bad_tenancy_field_is_an_invalid_spec_naming_it(tenancy, field):
    with pytest.raises(InvalidSpec, match=field):
        parse_pool(pool_body(router={"tenancy": tenancy}))


def test_the_schema_rejects_a_negative_queue_bound():
    body = pool_body(router={"tenancy": {"maxInflightPerPod": -1}})
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(SCHEMA).validate(body)


def test_tenant_priorities_put_the_engines_on_the_priority_policy():
    from epdserve.operator.engine import engine_command

    def policy(tenancy, args=()):
        roles = {"colocated": {"replicas": 1, "args": list(args)}}
        command = engine_command(parse_pool(pool_body(roles=roles, router=tenancy)), "colocated")
        return [command[i + 1] for i, a in enumerate(command) if a == "--scheduling-policy"]

    assert policy({"tenancy": {**TENANCY, "priority": True}}) == ["priority"]
    assert policy({"tenancy": TENANCY}) == []
    assert policy({}) == []
    own = ["--scheduling-policy", "fcfs"]  # the role's own choice stands, once
    assert policy({"tenancy": {**TENANCY, "priority": True}}, own) == ["fcfs"]
