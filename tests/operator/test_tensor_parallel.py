"""`tensorParallelSize` per role: the ranks' GPUs, cores, /dev/shm and engine setting in the
rendered pod; the schema's bounds; the spec errors, each naming its field."""

from __future__ import annotations

import jsonschema
import pytest
from ipool_samples import example, pool_body
from test_builders import container_of, env_of
from test_manifests import SCHEMA

from epdserve.operator import engine
from epdserve.operator.spec import InvalidSpec, parse_pool

PD = {"backend": "redis", "redis": {"managed": True}}


def deployment(body: dict, role: str) -> dict:
    return engine.build_engine_deployment(parse_pool(body), role)


def shm_of(dep: dict) -> tuple[dict, dict]:
    """(the dshm volume, its mount)."""
    pod = dep["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "dshm")
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "dshm")
    return volume, mount


def cpu_pool(**role) -> dict:
    return pool_body(roles={"colocated": role})


def test_a_tp2_gpu_role_gets_two_gpus_a_sized_shm_and_the_engine_setting():
    body = example("gpu-pool/qwen-gpu-tp")
    prefill = deployment(body, "prefill")
    resources = container_of(prefill)["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == "2"
    env = env_of(prefill)
    assert env["EPDSERVE_TENSOR_PARALLEL_SIZE"] == "2" and env["EPDSERVE_DEVICE"] == "cuda"
    volume, mount = shm_of(prefill)
    assert volume["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Gi"}  # 512Mi per rank
    assert mount["mountPath"] == "/dev/shm"


def test_the_tp1_decode_beside_it_keeps_one_gpu_and_no_setting():
    decode = deployment(example("gpu-pool/qwen-gpu-tp"), "decode")
    assert container_of(decode)["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert "EPDSERVE_TENSOR_PARALLEL_SIZE" not in env_of(decode)
    assert shm_of(decode)[0]["emptyDir"] == {"medium": "Memory"}


def test_cpus_per_rank_make_the_pods_cpu_and_its_engine_count():
    dep = deployment(cpu_pool(tensorParallelSize=2, cpusPerRank=3), "colocated")
    resources = container_of(dep)["resources"]
    assert resources == {"requests": {"cpu": "6"}, "limits": {"cpu": "6"}}
    env = env_of(dep)
    assert env["EPDSERVE_CPUS"] == "6" and env["EPDSERVE_TENSOR_PARALLEL_SIZE"] == "2"
    assert "EPDSERVE_DEVICE" not in env  # a CPU role: the engine's own choice
    assert shm_of(dep)[0]["emptyDir"]["sizeLimit"] == "512Mi"  # 256Mi per rank


def test_without_cpus_per_rank_resources_stay_the_pods_total():
    dep = deployment(
        cpu_pool(tensorParallelSize=4, resources={"limits": {"cpu": "8"}}), "colocated"
    )
    assert container_of(dep)["resources"] == {"limits": {"cpu": "8"}}
    assert env_of(dep)["EPDSERVE_CPUS"] == "8"  # the pod's total; the engine splits it by rank


def test_tp1_renders_exactly_what_a_pool_without_the_field_renders():
    plain = pool_body(roles={"prefill": {}, "decode": {"gpus": 1}}, cache=PD)
    explicit = pool_body(
        roles={
            "prefill": {"tensorParallelSize": 1},
            "decode": {"gpus": 1, "tensorParallelSize": 1},
        },
        cache=PD,
    )
    for role in ("prefill", "decode"):
        dep = deployment(explicit, role)
        assert dep == deployment(plain, role)
        assert shm_of(dep)[0]["emptyDir"] == {"medium": "Memory"}
        assert "EPDSERVE_TENSOR_PARALLEL_SIZE" not in env_of(dep)


@pytest.mark.parametrize(("ranks", "shm", "size"), [(1, "2Gi", "2Gi"), (2, 268435456, "268435456")])
def test_shm_size_overrides_the_default_at_any_rank_count(ranks, shm, size):
    dep = deployment(cpu_pool(tensorParallelSize=ranks, shmSize=shm), "colocated")
    assert shm_of(dep)[0]["emptyDir"] == {"medium": "Memory", "sizeLimit": size}


def test_the_default_shm_grows_with_the_ranks():
    body = pool_body(roles={"colocated": {"gpus": 8, "tensorParallelSize": 8}})
    assert shm_of(deployment(body, "colocated"))[0]["emptyDir"]["sizeLimit"] == "4Gi"
    body = cpu_pool(tensorParallelSize=3)
    assert shm_of(deployment(body, "colocated"))[0]["emptyDir"]["sizeLimit"] == "768Mi"


def _schema_errors(role: str, **fields) -> str:
    body = pool_body(roles={role: fields})
    errors = jsonschema.Draft7Validator(SCHEMA).iter_errors(body)
    return "; ".join(e.message for e in errors)


@pytest.mark.parametrize(
    ("role", "fields", "message"),
    [
        ("prefill", {"tensorParallelSize": 0}, "less than the minimum of 1"),
        ("decode", {"tensorParallelSize": 65}, "greater than the maximum of 64"),
        ("colocated", {"tensorParallelSize": 1.5}, "is not of type 'integer'"),
        ("colocated", {"tensorParallelSize": "2"}, "is not of type 'integer'"),
        ("encoder", {"tensorParallelSize": 2}, "greater than the maximum of 1"),
        ("decode", {"cpusPerRank": 0}, "less than the minimum of 1"),
        ("decode", {"shmSize": "lots"}, "does not match"),
    ],
)
def test_the_schema_rejects_bad_rank_fields(role, fields, message):
    assert message in _schema_errors(role, **fields)


def test_the_schema_accepts_one_to_sixty_four_ranks():
    assert _schema_errors("prefill", tensorParallelSize=64, cpusPerRank=2, shmSize="2Gi") == ""
    assert _schema_errors("encoder", tensorParallelSize=1) == ""


@pytest.mark.parametrize(
    ("role", "fields", "message"),
    [
        ("prefill", {"tensorParallelSize": 0}, r"spec\.roles\.prefill\.tensorParallelSize: .*0"),
        ("prefill", {"tensorParallelSize": "2"}, r"spec\.roles\.prefill\.tensorParallelSize"),
        ("decode", {"tensorParallelSize": True}, r"spec\.roles\.decode\.tensorParallelSize"),
        ("decode", {"tensorParallelSize": 65}, r"spec\.roles\.decode\.tensorParallelSize: at most"),
        ("encoder", {"tensorParallelSize": 2}, r"spec\.roles\.encoder\.tensorParallelSize: .*one"),
        ("prefill", {"tensorParallelSize": 2, "gpus": 1}, r"spec\.roles\.prefill\.gpus: .*gpus: 2"),
        (
            "prefill",
            {"tensorParallelSize": 2, "resources": {"limits": {"nvidia.com/gpu": 4}}},
            r"spec\.roles\.prefill\.gpus: .*\(got 4\)",
        ),
        (
            "decode",
            {"tensorParallelSize": 2, "resources": {"limits": {"cpu": "1500m"}}},
            r"spec\.roles\.decode\.resources: 2 CPU ranks .*\(got 1\)",
        ),
        (
            "decode",
            {"cpusPerRank": 2, "resources": {"requests": {"cpu": "4"}}},
            r"spec\.roles\.decode\.cpusPerRank: .*leave cpu out",
        ),
        ("decode", {"cpusPerRank": 0}, r"spec\.roles\.decode\.cpusPerRank"),
        ("decode", {"shmSize": "lots"}, r"spec\.roles\.decode\.shmSize"),
        ("decode", {"shmSize": 0}, r"spec\.roles\.decode\.shmSize"),
        ("decode", {"args": ["-tp", "2"]}, r"spec\.roles\.decode\.args: -tp: set .*Size"),
        (
            "decode",
            {"args": ["--tensor-parallel-size=2"]},
            r"spec\.roles\.decode\.args: --tensor-parallel-size: ",
        ),
        (
            "decode",
            {"env": [{"name": "EPDSERVE_TENSOR_PARALLEL_SIZE", "value": "2"}]},
            r"spec\.roles\.decode\.env: EPDSERVE_TENSOR_PARALLEL_SIZE: ",
        ),
    ],
)
def test_spec_errors_name_the_field(role, fields, message):
    roles = {"prefill": {}, "decode": {}, role: fields}
    with pytest.raises(InvalidSpec, match=message):
        parse_pool(pool_body(roles=roles, cache=PD))


def test_a_gpu_role_on_a_cuda_pool_needs_no_cpu_per_rank():
    body = pool_body(
        roles={"colocated": {"tensorParallelSize": 4, "resources": {"limits": {"cpu": "2"}}}},
        engine={"image": "img:1", "device": "cuda"},  # GPUs given by other means
    )
    dep = deployment(body, "colocated")
    assert env_of(dep)["EPDSERVE_TENSOR_PARALLEL_SIZE"] == "4"
    assert "nvidia.com/gpu" not in container_of(dep)["resources"]["limits"]
    assert shm_of(dep)[0]["emptyDir"]["sizeLimit"] == "2Gi"
