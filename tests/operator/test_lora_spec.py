"""`spec.lora`: validation naming the field (parser and CRD schema), and what it adds to the
pods — serve flags, the adapter list, volumes, download init containers, router flags — and
which changes roll the pods."""

from __future__ import annotations

import copy

import jsonschema
import kubernetes_validate
import pytest
from ipool_samples import example, pool_body
from test_manifests import SCHEMA, all_manifests

from epdserve.operator import engine, router
from epdserve.operator.desired import desired_objects
from epdserve.operator.spec import InvalidSpec, parse_pool

PATH = {"name": "sql", "source": {"path": "/opt/adapters/sql"}}
PVC = {"name": "chat-de", "source": {"pvc": {"claimName": "adapters", "path": "de/v2"}}}
HUB = {"name": "hub", "source": {"huggingFace": {"repo": "org/hub-lora", "revision": "r1"}}}


def lora_body(adapters=(PATH, PVC, HUB), **lora) -> dict:
    body = pool_body("lp")
    body["spec"]["lora"] = {"adapters": copy.deepcopy(list(adapters)), **lora}
    return body


def pod_spec(body: dict, role: str = "colocated") -> dict:
    return engine.build_engine_deployment(parse_pool(body), role)["spec"]["template"]["spec"]


def engine_container(body: dict, role: str = "colocated") -> dict:
    return pod_spec(body, role)["containers"][0]


@pytest.mark.parametrize(
    ("lora", "field"),
    [
        ({"adapters": [PATH, PATH]}, r"spec.lora.adapters\[1\].name: 'sql' is also adapters\[0\]"),
        ({"adapters": [{**PATH, "name": "a/b"}]}, r"spec.lora.adapters\[0\].name"),
        ({"adapters": [{**PATH, "name": "-x"}]}, r"spec.lora.adapters\[0\].name"),
        ({"adapters": [{**PATH, "name": "tiny"}]}, r"adapters\[0\].name: 'tiny' is the served"),
        (
            {"adapters": [{"name": "a", "source": {"path": "/a", "pvc": {"claimName": "c"}}}]},
            r"spec.lora.adapters\[0\].source: set exactly one of huggingFace, pvc, path \(found 2",
        ),
        ({"adapters": [{"name": "a", "source": {}}]}, r"adapters\[0\].source: set exactly one"),
        ({"adapters": [{"name": "a", "source": {"path": "rel"}}]}, r"source.path: an absolute"),
        ({"adapters": [{"name": "a", "source": {"path": "/a b"}}]}, r"source.path: a non-empty"),
        (
            {"adapters": [{"name": "a", "source": {"pvc": {"path": "x"}}}]},
            r"adapters\[0\].source.pvc.claimName is required",
        ),
        (
            {"adapters": [{"name": "a", "source": {"pvc": {"claimName": "c", "path": "../x"}}}]},
            r"adapters\[0\].source.pvc.path",
        ),
        (
            {"adapters": [{"name": "a", "source": {"huggingFace": {"revision": "r"}}}]},
            r"adapters\[0\].source.huggingFace.repo is required",
        ),
        ({"adapters": [PATH], "maxLoras": 0}, r"spec.lora.maxLoras: an integer in 1..256"),
        ({"adapters": [PATH], "maxRank": 513}, r"spec.lora.maxRank: an integer in 1..512"),
        ({"adapters": [PATH], "maxRank": 0}, r"spec.lora.maxRank"),
        ({"adapters": [PATH], "dynamic": "yes"}, r"spec.lora.dynamic: true or false"),
    ],
)
def test_invalid_lora_specs_are_refused_naming_the_field(lora, field):
    body = pool_body("lp")
    body["spec"]["lora"] = lora
    with pytest.raises(InvalidSpec, match=field):
        parse_pool(body)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda lora: lora.update(maxRank=1024), "maximum"),
        (lambda lora: lora.update(maxLoras=0), "minimum"),
        (lambda lora: lora["adapters"][0].update(name="a/b"), "does not match"),
        (lambda lora: lora["adapters"][0].pop("source"), "'source' is a required property"),
        (lambda lora: lora["adapters"][2]["source"]["huggingFace"].pop("repo"), "'repo' is a"),
        (lambda lora: lora["adapters"][0]["source"].update(path="relative"), "does not match"),
    ],
)
def test_the_crd_schema_refuses_the_same_mistakes(mutate, message):
    body = lora_body()
    body["metadata"] = {"name": "lp"}
    jsonschema.Draft7Validator(SCHEMA).validate(body)
    mutate(body["spec"]["lora"])
    with pytest.raises(jsonschema.ValidationError, match=message):
        jsonschema.Draft7Validator(SCHEMA).validate(body)


def test_defaults_are_one_slot_rank_16_and_static():
    lora = parse_pool(lora_body([PATH])).lora
    assert (lora.max_loras, lora.max_rank, lora.dynamic) == (1, 16, False)
    assert parse_pool(pool_body()).lora is None


def test_a_static_pool_lists_every_adapter_in_the_engine_command():
    command = engine_container(lora_body(maxLoras=4, maxRank=64))["command"]
    tail = command[command.index("--enable-lora") :]
    assert tail == [
        "--enable-lora",
        *("--max-loras", "4", "--max-lora-rank", "64"),
        *("--lora-modules", "sql=/opt/adapters/sql"),
        *("--lora-modules", "chat-de=/lora-pvc/adapters/de/v2"),
        *("--lora-modules", "hub=/lora/hub"),
    ]


def test_a_dynamic_pool_allows_runtime_updates_and_reads_the_list_from_the_config_map():
    body = lora_body(dynamic=True)
    container = engine_container(body)
    assert "--allow-runtime-lora-updating" in container["command"]
    assert "--lora-modules" not in container["command"]
    (env,) = [e for e in container["env"] if e["name"] == "EPDSERVE_LORA_MODULES"]
    assert env["valueFrom"]["configMapKeyRef"] == {"name": "lp-config", "key": "lora-modules"}
    data = engine.build_config_map(parse_pool(body))["data"]
    assert (
        data["lora-modules"]
        == "sql=/opt/adapters/sql chat-de=/lora-pvc/adapters/de/v2 hub=/lora/hub"
    )


def test_user_args_come_after_the_lora_flags_so_they_win():
    body = lora_body([PATH])
    body["spec"]["roles"]["colocated"]["args"] = ["--max-loras", "8"]
    assert engine_container(body)["command"][-2:] == ["--max-loras", "8"]


def test_adapter_pvcs_are_mounted_read_only_and_the_models_claim_is_reused():
    spec = pod_spec(lora_body())
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["lora-pvc-0"]["persistentVolumeClaim"] == {
        "claimName": "adapters",
        "readOnly": True,
    }
    mounts = {m["name"]: m for m in spec["containers"][0]["volumeMounts"]}
    assert mounts["lora-pvc-0"] == {
        "name": "lora-pvc-0",
        "mountPath": "/lora-pvc/adapters",
        "readOnly": True,
    }
    assert mounts["lora"] == {"name": "lora", "mountPath": "/lora", "readOnly": True}
    body = lora_body([PVC])
    body["spec"]["model"]["source"] = {"pvc": {"claimName": "adapters", "path": "base"}}
    spec = pod_spec(body)
    assert not [v for v in spec["volumes"] if v["name"].startswith("lora")]
    assert "chat-de=/models/de/v2" in spec["containers"][0]["command"]


def test_hub_adapters_are_downloaded_by_init_containers_with_the_models_token():
    body = lora_body(
        [
            PATH,
            HUB,
            {
                "name": "own",
                "source": {"huggingFace": {"repo": "o/x", "tokenSecretRef": {"name": "t2"}}},
            },
        ]
    )
    body["spec"]["model"]["source"] = {
        "huggingFace": {"id": "org/base", "tokenSecretRef": {"name": "hf"}}
    }
    inits = pod_spec(body)["initContainers"]
    assert [i["name"] for i in inits] == ["download-model", "download-lora-1", "download-lora-2"]
    assert inits[1]["command"] == [
        "epdserve",
        "download",
        "org/hub-lora",
        "--revision",
        "r1",
        "--link",
        "/lora/hub",
    ]
    assert inits[2]["command"] == ["epdserve", "download", "o/x", "--link", "/lora/own"]
    tokens = [next(e for e in i["env"] if e["name"] == "HF_TOKEN")["valueFrom"] for i in inits[1:]]
    assert tokens == [
        {"secretKeyRef": {"name": "hf", "key": "token"}},
        {"secretKeyRef": {"name": "t2", "key": "token"}},
    ]
    for init in inits[1:]:
        mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
        assert mounts == {"tmp": "/tmp", "hf-cache": "/var/cache/huggingface", "lora": "/lora"}
    assert "HF_TOKEN" not in {e["name"] for e in pod_spec(body)["containers"][0]["env"]}


def test_encoder_pods_get_no_lora_flags_volumes_or_downloads():
    body = lora_body(dynamic=True)
    body["spec"]["roles"] = {"encoder": {}, "prefill": {}, "decode": {}}
    body["spec"]["cache"] = {"backend": "redis", "redis": {"managed": True}}
    encoder = pod_spec(body, "encoder")
    assert "--enable-lora" not in encoder["containers"][0]["command"]
    assert "initContainers" not in encoder and not [
        v for v in encoder["volumes"] if "lora" in v["name"]
    ]
    assert not [e for e in encoder["containers"][0]["env"] if "LORA" in e["name"]]
    for role in ("prefill", "decode"):
        assert "--enable-lora" in engine_container(body, role)["command"]


def test_the_router_gets_the_list_and_for_a_dynamic_pool_the_switch():
    items = [
        "--lora-modules",
        "sql=/opt/adapters/sql",
        "--lora-modules",
        "chat-de=/lora-pvc/adapters/de/v2",
    ]
    static = router.router_command(parse_pool(lora_body([PATH, PVC])))
    assert static[-4:] == items and "--dynamic-lora" not in static
    dynamic = router.router_command(parse_pool(lora_body([PATH, PVC], dynamic=True)))
    assert dynamic[-5:] == ["--dynamic-lora", *items]
    assert "--dynamic-lora" not in router.router_command(parse_pool(pool_body()))
    assert "--lora-modules" not in router.router_command(parse_pool(pool_body()))


def _deployments(body: dict) -> dict:
    return {
        o["metadata"]["name"]: o
        for o in desired_objects(parse_pool(body))
        if o["kind"] == "Deployment"
    }


def test_a_dynamic_pool_changing_path_or_mounted_pvc_adapters_rolls_only_the_router():
    before = _deployments(lora_body([PATH, PVC], dynamic=True))
    renamed = {**PVC, "name": "chat-fr", "source": {"pvc": {"claimName": "adapters", "path": "fr"}}}
    after = _deployments(lora_body([renamed, {**PATH, "name": "sql2"}], dynamic=True))
    assert after["lp-colocated"] == before["lp-colocated"]
    router_template = after["lp-router"]["spec"]["template"]
    assert router_template != before["lp-router"]["spec"]["template"]
    assert "chat-fr=/lora-pvc/adapters/fr" in router_template["spec"]["containers"][0]["command"]


def test_a_dynamic_pool_rolls_for_a_new_hub_adapter_and_a_static_pool_for_any_change():
    before = _deployments(lora_body([PATH], dynamic=True))
    assert (
        _deployments(lora_body([PATH, HUB], dynamic=True))["lp-colocated"] != before["lp-colocated"]
    )
    static = _deployments(lora_body([PATH]))["lp-colocated"]
    changed = _deployments(lora_body([{**PATH, "name": "sql2"}]))["lp-colocated"]
    assert changed["spec"]["template"] != static["spec"]["template"]


@pytest.mark.parametrize("dynamic", [False, True])
def test_every_manifest_of_a_lora_pool_is_valid_kubernetes(dynamic):
    body = lora_body(dynamic=dynamic)
    body["spec"]["model"]["source"] = {"huggingFace": {"id": "org/base"}}
    for obj in all_manifests(body):
        if not obj["apiVersion"].startswith("monitoring.coreos.com"):
            kubernetes_validate.validate(obj, "1.33.0", strict=True)


def test_the_example_is_a_valid_dynamic_pool_with_one_adapter_of_each_source():
    pool = parse_pool(example("inferencepool-lora"))
    assert pool.lora.dynamic and {a.kind for a in pool.lora.adapters} == {
        "huggingFace",
        "pvc",
        "path",
    }
