"""The commands and environment the operator's builders give pods are what ``epdserve serve``
and ``epdserve router`` accept: every flag name and ``EPDSERVE_*`` variable parses into the
typed configs, with the values the pool asked for."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
from ipool_samples import EXAMPLE_POOLS, example

from epdserve.common.cli_fields import from_args
from epdserve.operator import engine, router
from epdserve.operator.spec import SERVE_ROLE, parse_pool

# set where a pod runs, not here: the GPU, the Curve key files, a Secret's value
NOT_HERE = {"EPDSERVE_DEVICE", "EPDSERVE_KV_EVENTS_CURVE_DIR", "EPDSERVE_REDIS_PASSWORD"}


def pod_env(pool, deployment: dict) -> dict[str, str]:
    """The container's EPDSERVE_* variables, ConfigMap references resolved."""
    data = engine.build_config_map(pool)["data"]
    env = {}
    for item in deployment["spec"]["template"]["spec"]["containers"][0]["env"]:
        name = item["name"]
        if not name.startswith("EPDSERVE_") or name in NOT_HERE:
            continue
        ref = item.get("valueFrom", {}).get("configMapKeyRef")
        if ref is not None:
            env[name] = data[ref["key"]]
        elif "value" in item:
            env[name] = item["value"]
    return env


def parse(module, argv: list[str], env: dict, monkeypatch) -> argparse.Namespace:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize("name", EXAMPLE_POOLS)
def test_every_engine_pod_of_the_examples_parses_into_an_engine_config(name, monkeypatch):
    from epdserve.engine.config import EngineConfig
    from epdserve.engine.entrypoints import serve_cli

    pool = parse_pool(example(name))
    for role in pool.roles:
        with monkeypatch.context() as m:
            deployment = engine.build_engine_deployment(pool, role)
            command = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
            assert command[:2] == ["epdserve", "serve"]
            args = parse(serve_cli, command[2:], pod_env(pool, deployment), m)
            config = from_args(EngineConfig, args, device="cpu")
            serving = from_args(serve_cli.ServeOptions, args)
        assert config.role == SERVE_ROLE[role] and config.hash_seed == pool.hash_seed
        assert (serving.host, serving.port, serving.served_model_name) == (
            "0.0.0.0",
            8000,
            pool.served_name,
        )
        kv = engine.kv_transfer_config(pool, role)
        assert (config.kv_transfer_config is None) == (kv is None)
        if kv is not None:
            assert config.kv_transfer_config.kv_role == kv["kv_role"]
        ec = engine.ec_transfer_config(pool, role)
        assert (config.ec_transfer_config is None) == (ec is None)
        assert config.enable_kv_events == (pool.kv_events and role != "encoder")


@pytest.mark.parametrize("name", EXAMPLE_POOLS)
def test_every_engine_pod_of_the_examples_runs_the_ranks_its_role_asks_for(name, monkeypatch):
    from epdserve.engine.config import EngineConfig
    from epdserve.engine.entrypoints import serve_cli

    if "tensor_parallel_size" not in {f.name for f in dataclasses.fields(EngineConfig)}:
        pytest.skip("the engine has no --tensor-parallel-size yet")
    pool = parse_pool(example(name))
    for role in pool.roles:
        with monkeypatch.context() as m:
            deployment = engine.build_engine_deployment(pool, role)
            command = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
            args = parse(serve_cli, command[2:], pod_env(pool, deployment), m)
            config = from_args(EngineConfig, args, device="cpu")
        assert config.tensor_parallel_size == pool.roles[role].parallel.tensor_parallel_size


@pytest.mark.parametrize("name", EXAMPLE_POOLS)
def test_the_router_pod_of_the_examples_parses_into_a_router_config(name, monkeypatch):
    from epdserve.router import cli
    from epdserve.router.config import RouterConfig

    pool = parse_pool(example(name))
    deployment = router.build_router_deployment(pool)
    command = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:2] == ["epdserve", "router"]
    config = from_args(
        RouterConfig, parse(cli, command[2:], pod_env(pool, deployment), monkeypatch)
    )
    assert (config.discovery, config.strategy) == ("k8s", pool.router.strategy)
    assert config.selector.startswith("epdserve.io/pool=") and config.port == 8000
