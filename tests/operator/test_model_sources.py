"""HuggingFace model sources and GPU pools: the download init container, the shared cache
volume, offline engines, GPU requests and the device the engines are told to use."""

from __future__ import annotations

import jsonschema
import pytest
from ipool_samples import example, pool_body
from test_builders import container_of, env_of
from test_manifests import SCHEMA

from epdserve.operator import engine, router
from epdserve.operator.spec import InvalidSpec, parse_pool

HUB = {"id": "org/model", "revision": "v1", "tokenSecretRef": {"name": "hf"}}


def pod_of(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]


def hub_pool(**source) -> dict:
    body = pool_body()
    body["spec"]["model"]["source"] = {"huggingFace": {**HUB, **source}}
    return body


def test_engine_pods_download_first_then_serve_the_id_offline():
    pool = parse_pool(example("gpu-pool"))
    pod = pod_of(engine.build_engine_deployment(pool, "decode"))
    (init,) = pod["initContainers"]
    assert init["command"] == ["epdserve", "download", "Qwen/Qwen3-8B", "--revision", "main"]
    assert init["image"] == pool.image
    init_env = {e["name"]: e.get("value", e.get("valueFrom")) for e in init["env"]}
    assert init_env["HF_TOKEN"] == {"secretKeyRef": {"name": "hf-token", "key": "token"}}
    assert init_env["HF_HOME"] == "/var/cache/huggingface"
    main = container_of(engine.build_engine_deployment(pool, "decode"))
    assert main["command"][2] == "Qwen/Qwen3-8B"
    env = env_of(engine.build_engine_deployment(pool, "decode"))
    assert env["HF_HUB_OFFLINE"] == "1" and env["EPDSERVE_REVISION"] == "main"
    assert "HF_TOKEN" not in env  # only the download sees the token


def test_init_and_engine_share_the_cache_volume_at_hf_home():
    pod = pod_of(engine.build_engine_deployment(parse_pool(example("gpu-pool")), "prefill"))
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["hf-cache"]["persistentVolumeClaim"] == {"claimName": "hf-cache"}
    for container in pod["initContainers"] + pod["containers"]:
        assert {"name": "hf-cache", "mountPath": "/var/cache/huggingface"} in container[
            "volumeMounts"
        ]


@pytest.mark.parametrize(
    ("cache", "volume"),
    [
        ({}, {"emptyDir": {}}),
        ({"hostPath": "/var/lib/hf"}, {"hostPath": {"path": "/var/lib/hf", "type": "DirectoryOrCreate"}}),
    ],
)  # fmt: skip
def test_the_cache_is_a_node_directory_or_else_per_pod(cache, volume):
    pool = parse_pool(hub_pool(cache=cache))
    pod = pod_of(engine.build_engine_deployment(pool, "colocated"))
    assert {"name": "hf-cache", **volume} in pod["volumes"]


def test_without_revision_or_token_the_download_is_plain():
    pool = parse_pool(hub_pool(revision=None, tokenSecretRef=None))
    pod = pod_of(engine.build_engine_deployment(pool, "colocated"))
    assert pod["initContainers"][0]["command"] == ["epdserve", "download", "org/model"]
    assert "HF_TOKEN" not in {e["name"] for e in pod["initContainers"][0]["env"]}
    assert "EPDSERVE_REVISION" not in env_of(engine.build_engine_deployment(pool, "colocated"))


def test_the_router_reads_the_tokenizer_through_a_link_to_the_snapshot():
    pool = parse_pool(example("gpu-pool"))
    dep = router.build_router_deployment(pool)
    pod = pod_of(dep)
    (init,) = pod["initContainers"]
    assert init["image"] == pool.image  # the engine image carries the hub client
    assert init["command"][-2:] == ["--link", "/tmp/model"]
    command = container_of(dep)["command"]
    assert command[command.index("--model") + 1] == "/tmp/model"
    assert {"name": "hf-cache", "persistentVolumeClaim": {"claimName": "hf-cache"}} in pod[
        "volumes"
    ]


def test_pools_from_a_volume_or_the_image_have_no_init_container():
    for name in ("pd-redis", "epd-multimodal"):
        pool = parse_pool(example(name))
        for role in pool.roles:
            assert "initContainers" not in pod_of(engine.build_engine_deployment(pool, role))
        assert "HF_HUB_OFFLINE" not in env_of(engine.build_engine_deployment(pool, role))


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("org/model", "an object"),
        ({"revision": "v1"}, "huggingFace.id is required"),
        ({"id": "a/b", "cache": {"claimName": "c", "hostPath": "/h"}}, "at most one of"),
        ({"id": "a/b", "tokenSecretRef": {"key": "k"}}, "tokenSecretRef.name"),
    ],
)
def test_bad_hub_sources_are_refused_naming_the_field(source, message):
    body = pool_body()
    body["spec"]["model"]["source"] = {"huggingFace": source}
    with pytest.raises(InvalidSpec, match=message):
        parse_pool(body)


def test_gpu_roles_request_gpus_and_run_on_cuda_with_the_memory_share():
    pool = parse_pool(example("gpu-pool"))
    dep = engine.build_engine_deployment(pool, "prefill")
    resources = container_of(dep)["resources"]
    assert resources["requests"] == {"cpu": "4", "memory": "32Gi", "nvidia.com/gpu": "1"}
    assert resources["limits"] == {"memory": "32Gi", "nvidia.com/gpu": "1"}
    env = env_of(dep)
    assert env["EPDSERVE_DEVICE"] == "cuda" and env["EPDSERVE_GPU_MEMORY_UTILIZATION"] == "0.9"
    pod = pod_of(dep)
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"


def test_gpus_named_only_in_resources_count_too():
    pool = parse_pool(example("pd-redis"))  # limits: {nvidia.com/gpu: 1}
    assert pool.roles["decode"].gpus == 1
    dep = engine.build_engine_deployment(pool, "decode")
    assert container_of(dep)["resources"]["requests"] == {"nvidia.com/gpu": "1"}
    assert env_of(dep)["EPDSERVE_DEVICE"] == "cuda"


def test_cpu_roles_leave_the_device_to_the_engine_and_explicit_devices_are_passed():
    body = pool_body(engine={"image": "img:1", "gpuMemoryUtilization": 0.5})
    env = env_of(engine.build_engine_deployment(parse_pool(body), "colocated"))
    assert "EPDSERVE_DEVICE" not in env and "EPDSERVE_GPU_MEMORY_UTILIZATION" not in env
    body["spec"]["engine"]["device"] = "cuda"  # e.g. GPUs given by other means
    env = env_of(engine.build_engine_deployment(parse_pool(body), "colocated"))
    assert env["EPDSERVE_DEVICE"] == "cuda" and env["EPDSERVE_GPU_MEMORY_UTILIZATION"] == "0.5"


def test_a_role_env_overrides_the_memory_share():
    body = example("gpu-pool")
    body["spec"]["roles"]["decode"]["env"] = [
        {"name": "EPDSERVE_GPU_MEMORY_UTILIZATION", "value": "0.8"}
    ]
    container = container_of(engine.build_engine_deployment(parse_pool(body), "decode"))
    last = [e for e in container["env"] if e["name"] == "EPDSERVE_GPU_MEMORY_UTILIZATION"][-1]
    assert last["value"] == "0.8"  # later entries win in a Pod spec


@pytest.mark.parametrize(
    ("roles", "engine_fields", "message"),
    [
        ({"colocated": {"gpus": 1}}, {"device": "cpu"}, "cpu, but roles colocated ask for GPUs"),
        ({"colocated": {"gpus": 2, "resources": {"limits": {"nvidia.com/gpu": 1}}}}, {}, "one whole count"),
        ({"colocated": {"resources": {"limits": {"nvidia.com/gpu": "500m"}}}}, {}, "one whole count"),
        ({"colocated": {}}, {"gpuMemoryUtilization": 0}, "gpuMemoryUtilization"),
    ],
)  # fmt: skip
def test_impossible_gpu_specs_are_refused(roles, engine_fields, message):
    body = pool_body(roles=roles, engine={"image": "img:1", **engine_fields})
    with pytest.raises(InvalidSpec, match=message):
        parse_pool(body)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda s: s["engine"].update(device="tpu"),
        lambda s: s["engine"].update(gpuMemoryUtilization=1.5),
        lambda s: s["roles"]["colocated"].update(gpus=-1),
        lambda s: s["model"].update(source={"huggingFace": "org/model"}),
        lambda s: s["model"].update(source={"huggingFace": {"id": "a/b", "cache": {"hostPath": "x"}}}),
    ],
)  # fmt: skip
def test_schema_rejects_bad_gpu_and_hub_fields(mutate):
    body = pool_body()
    mutate(body["spec"])
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(SCHEMA).validate(body)
