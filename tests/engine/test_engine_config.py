"""``epdserve serve``'s flags are EngineConfig's and ServeOptions' fields; the config is typed
from the edge to the engine-core process."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import pytest

from epdserve.common.cli_fields import from_args
from epdserve.connectors.ec_connector import ECTransferConfig
from epdserve.connectors.kv_connector import KVTransferConfig
from epdserve.connectors.kv_events import KVEventsConfig
from epdserve.engine.config import EngineConfig, decode_config, encode_config
from epdserve.engine.entrypoints import serve_cli

# every flag `epdserve serve` had before its flags were made from the fields, with its default
# (block_size: None, resolved by device: 128 on cpu, 16 on cuda; max_num_batched_tokens: None,
# resolved by the core: 2048, on cpu by model size; stream_interval is new)
SERVE_DEFAULTS = {
    "model": "m", "revision": None, "host": "127.0.0.1", "port": 8000,
    "served_model_name": None, "api_key": None, "processed_prompt_key": None, "role": "both",
    "dtype": "float32",
    "device": "auto", "gpu_memory_utilization": 0.9, "attention_backend": None,
    "max_model_len": None, "kv_cache_memory": None, "kv_cache_dtype": "auto", "block_size": None,
    "max_num_seqs": 256,
    "max_num_batched_tokens": None, "scheduling_policy": "fcfs", "stream_interval": 1,
    "async_scheduling": None,
    "enable_prefix_caching": True,
    "disable_hybrid_kv_cache_manager": False, "prefix_caching_hash_algo": "sha256_cbor",
    "hash_seed": None, "seed": 0, "kv_events_config": None, "kv_events_curve_dir": None,
    "kv_transfer_config": None, "ec_transfer_config": None, "mm_processor_kwargs": None,
    "max_logprobs": 20, "max_request_body_bytes": 32 << 20, "limit_mm_per_prompt": None,
    "max_image_pixels": 25_000_000, "max_pixels_per_request": 100_000_000,
    "allowed_media_domains": [], "allowed_local_media_path": None, "media_fetch_timeout": 10.0,
    "max_queued_requests": None, "limit_concurrency": None, "timeout_keep_alive": 5.0,
    "header_read_timeout": 10.0, "body_read_timeout": 60.0, "drain_timeout": 30.0,
    "log_level": "info", "log_format": "text", "access_log": False,
    "enable_lora": False, "lora_modules": [], "max_loras": 1, "max_lora_rank": 16,
    "max_cpu_loras": None, "allow_runtime_lora_updating": False,
    "enable_auto_tool_choice": False, "tool_call_parser": None,
    "tensor_parallel_size": 1, "distributed_executor_backend": None, "quantization": None,
}  # fmt: skip
REDIS = {"kv_connector": "RedisConnector", "kv_connector_extra_config": {"url": "redis://h/0"}}
EC = {"ec_connector": "SharedStorageECConnector", "ec_connector_extra_config": {"path": "/x"}}


def serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_serve_flags_keep_their_names_and_defaults(monkeypatch):
    for name in SERVE_DEFAULTS:
        monkeypatch.delenv("EPDSERVE_" + name.upper(), raising=False)
    assert vars(serve_args("m")) == SERVE_DEFAULTS
    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    flags = {s for a in parser._actions for s in a.option_strings} - {"-h", "--help"}
    named = {"--" + n.replace("_", "-") for n in SERVE_DEFAULTS if n != "model"}
    assert flags == named | {
        "--no-enable-prefix-caching",
        "--no-async-scheduling",
        "-tp",
    }  # -tp: vLLM's


def test_each_setting_reads_its_variable_typed(monkeypatch):
    env = {
        "EPDSERVE_MAX_NUM_SEQS": "8",
        "EPDSERVE_ENABLE_PREFIX_CACHING": "false",
        "EPDSERVE_GPU_MEMORY_UTILIZATION": "0.5",
        "EPDSERVE_ALLOWED_MEDIA_DOMAINS": "a.example b.example",
        "EPDSERVE_DRAIN_TIMEOUT": "1.5",
        "EPDSERVE_KV_TRANSFER_CONFIG": json.dumps(REDIS),
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = serve_args("m", "--device", "cpu")
    config, serving = from_args(EngineConfig, args), from_args(serve_cli.ServeOptions, args)
    assert (config.max_num_seqs, config.enable_prefix_caching) == (8, False)
    assert config.gpu_memory_utilization == 0.5
    assert config.kv_transfer_config == KVTransferConfig.parse(REDIS)
    assert serving.allowed_media_domains == ["a.example", "b.example"]
    assert serving.drain_timeout == 1.5


def test_json_settings_are_typed_objects_parsed_once():
    config = EngineConfig(
        model="m",
        device="cpu",
        kv_transfer_config=json.dumps(REDIS),
        ec_transfer_config=EC,  # the Python API may give a dict
        kv_events_config='{"enable_kv_cache_events": true}',
        mm_processor_kwargs='{"do_pan_and_scan": true}',
    )
    assert isinstance(config.kv_transfer_config, KVTransferConfig)
    assert isinstance(config.ec_transfer_config, ECTransferConfig)
    assert isinstance(config.kv_events_config, KVEventsConfig) and config.enable_kv_events
    assert config.mm_processor_kwargs == {"do_pan_and_scan": True}
    moved = replace(config, model="/snapshot")  # a copy keeps the objects: nothing re-parsed
    assert moved.kv_transfer_config is config.kv_transfer_config


def test_the_config_reaches_the_core_typed_and_equal():
    config = EngineConfig(
        model="m",
        device="cpu",
        dtype="auto",
        role="prefill",
        kv_transfer_config={**REDIS, "kv_role": "kv_producer"},
        ec_transfer_config=EC,
        kv_events_config={"enable_kv_cache_events": True, "topic": "t"},
        model_digest="d1",
        hash_seed="s",
    )
    decoded = decode_config(encode_config(config))
    assert decoded == config and decoded.dtype == "float32"
    assert isinstance(decoded.kv_transfer_config, KVTransferConfig)
    assert isinstance(decoded.ec_transfer_config, ECTransferConfig)
    assert decoded.kv_events_config.publisher == "zmq"


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("kv_transfer_config", {**REDIS, "kv_role": "both"}, "kv_transfer_config.kv_role"),
        ("kv_transfer_config", "{", "kv_transfer_config: not valid JSON"),
        ("ec_transfer_config", {"ec_connector": "RedisECConnector"}, "extra_config.url"),
        ("ec_transfer_config", {**EC, "ec_rank": 0}, "ec_transfer_config.ec_rank: unknown"),
        ("kv_events_config", {"publisher": "kafka"}, "kv_events_config.publisher"),
        ("kv_events_config", {"hwm": 0}, "kv_events_config.hwm: must be a positive"),
    ],
)
def test_a_bad_sub_config_is_refused_naming_the_key(field, value, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        EngineConfig(model="m", device="cpu", **{field: value})


def test_serve_refuses_a_variable_outside_the_choices_naming_the_field(monkeypatch):
    monkeypatch.setenv("EPDSERVE_ROLE", "leader")
    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    with pytest.raises(SystemExit) as exc:
        serve_cli.run(parser.parse_args(["/nonexistent-model", "--device", "cpu"]))
    assert "role: must be one of both, encoder, prefill, decode, got 'leader'" in str(exc.value)


def test_tensor_parallel_settings_are_checked_naming_the_field():
    assert EngineConfig(model="m", tensor_parallel_size=2).distributed_executor_backend == "mp"
    assert EngineConfig(model="m").distributed_executor_backend == "uni"
    assert vars(serve_args("m", "-tp", "4"))["tensor_parallel_size"] == 4
    with pytest.raises(ValueError, match="tensor_parallel_size: must be at least 1"):
        EngineConfig(model="m", tensor_parallel_size=0)
    with pytest.raises(ValueError, match="tensor_parallel_size: an encoder pod"):
        EngineConfig(model="m", role="encoder", ec_transfer_config=EC, tensor_parallel_size=2)
