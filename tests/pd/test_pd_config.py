"""``--role`` and ``--kv-transfer-config`` (or their EPDSERVE_* env) are checked at start-up."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from epdserve.connectors.kv_connector import KVTransferConfig
from epdserve.engine.entrypoints import serve_cli

REDIS = {"kv_connector": "RedisConnector", "kv_connector_extra_config": {"url": "redis://h:1/0"}}


def refusal(monkeypatch, *args, **env) -> str:
    """The message ``epdserve serve`` exits with (in-process, before any model loads)."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    with pytest.raises(SystemExit) as exc:
        serve_cli.run(parser.parse_args(["/nonexistent-model", *args]))
    return str(exc.value)


def serve(*args, **env):
    code = "import sys; from epdserve.engine.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", code, "serve", "/nonexistent-model", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=60,
    )


@pytest.mark.parametrize(
    "config, key",
    [
        ({**REDIS, "kv_role": "producer"}, "kv_transfer_config.kv_role"),
        ({"kv_connector": "NixlConnector"}, "kv_transfer_config.kv_connector"),
        ({"kv_connector": "RedisConnector"}, "kv_transfer_config.kv_connector_extra_config.url"),
        ({**REDIS, "kv_rank": 0}, "kv_transfer_config.kv_rank"),
        (
            {"kv_connector": "SharedStorageConnector", "kv_connector_extra_config": {"url": "x"}},
            "kv_transfer_config.kv_connector_extra_config.path",
        ),
    ],
)
def test_a_bad_kv_transfer_config_is_refused_naming_the_key(config, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        KVTransferConfig.parse(json.dumps(config))


def test_serve_exits_with_a_message_naming_the_bad_key():
    bad = json.dumps({**REDIS, "kv_role": "producer"})
    result = serve("--kv-transfer-config", bad)
    assert result.returncode != 0 and "kv_transfer_config.kv_role" in result.stderr


def test_the_env_configures_role_and_connector_like_the_flags(monkeypatch):
    config = json.dumps({**REDIS, "kv_role": "kv_consumer"})
    message = refusal(monkeypatch, EPDSERVE_ROLE="prefill", EPDSERVE_KV_TRANSFER_CONFIG=config)
    assert "role prefill needs a KV connector with kv_role kv_producer" in message


def test_a_decode_pod_without_a_connector_is_refused(monkeypatch):
    assert "kv_transfer_config" in refusal(monkeypatch, "--role", "decode")


def test_the_encoder_role_without_an_encoder_cache_connector_is_refused_clearly(monkeypatch):
    message = refusal(monkeypatch, "--role", "encoder")
    assert "ec_transfer_config" in message and "ec_producer" in message


@pytest.mark.parametrize(
    "flag, fragment",
    [
        ("{not json", "mm_processor_kwargs: not valid JSON"),
        ('{"do_pan_and_scan": 1}', "mm_processor_kwargs.do_pan_and_scan: wrong type"),
        ('{"pan_and_scan_max_num_crops": 0}', "mm_processor_kwargs.pan_and_scan_max_num_crops"),
    ],
)
def test_bad_mm_processor_kwargs_are_refused_at_start(monkeypatch, flag, fragment):
    assert fragment in refusal(monkeypatch, "--mm-processor-kwargs", flag)
    assert fragment in refusal(monkeypatch, EPDSERVE_MM_PROCESSOR_KWARGS=flag)
