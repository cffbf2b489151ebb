"""``epdserve router``'s flags are RouterConfig's fields: same names and defaults as before,
each also an ``EPDSERVE_*`` variable, checked with messages naming the flag."""

from __future__ import annotations

import argparse

import pytest

from epdserve.common.cli_fields import from_args
from epdserve.router import cli
from epdserve.router.config import RouterConfig

# every flag `epdserve router` had before its flags were made from the fields, with its default
ROUTER_DEFAULTS = {
    "host": "0.0.0.0", "port": 8000, "model": None, "served_model_name": None,
    "strategy": "prefix+load", "endpoint": [], "prefill_endpoint": [], "decode_endpoint": [],
    "encoder_endpoint": [], "discovery": "static", "namespace": "default", "selector": "",
    "kubeconfig": None, "target_port": 8000, "kv_events_port": 5557, "kv_replay_port": 5558,
    "kv_events_curve_dir": None, "kv_events_max_message_bytes": 8 << 20,
    "index_capacity": 1_000_000, "prefix_weight": 2.0, "load_weight": 1.0, "kv_weight": 0.5,
    "store_weight": 1.0, "balance_threshold": 4.0, "store_cost": 0.1, "decode_cost": 2.0, "recompute_cost": 0.5,
    "speculative_ttl": 2.0, "block_size": 16,
    "scrape_interval": 1.0, "connect_timeout": 2.0, "upstream_timeout": 600.0,
    "max_attempts": 3, "failure_backoff": 2.0, "max_body_bytes": 32 << 20,
    "limit_concurrency": 4096, "timeout_keep_alive": 5.0, "header_read_timeout": 10.0,
    "body_read_timeout": 60.0, "max_upstream_connections": 4096, "max_pod_connections": 1024,
    "lora_modules": [], "dynamic_lora": False, "lora_spread_load": 4.0,
    "lora_models_interval": 5.0, "tenant_keys": None, "tenant_header": None,
    "max_inflight_per_pod": 0, "tenant_reserve_per_pod": 0, "tenant_queue_size": 256,
    "tenant_queue_timeout": 30.0, "tenant_priority": False, "tenant_admission_header": False,
    "api_key": None, "processed_prompt_key": None,
    "log_level": "info", "log_format": "text", "access_log": False,
}  # fmt: skip
POD = ["--endpoint", "http://127.0.0.1:1"]


def router_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_router_flags_keep_their_names_and_defaults(monkeypatch):
    for name in ROUTER_DEFAULTS:
        monkeypatch.delenv("EPDSERVE_" + name.upper(), raising=False)
    assert vars(router_args()) == ROUTER_DEFAULTS


def test_every_router_flag_is_also_a_variable_and_the_flag_wins(monkeypatch):
    monkeypatch.setenv("EPDSERVE_MAX_ATTEMPTS", "5")
    monkeypatch.setenv("EPDSERVE_ENDPOINT", "http://a:1 http://b:2")
    monkeypatch.setenv("EPDSERVE_LOG_LEVEL", "DEBUG")
    config = from_args(RouterConfig, router_args())
    assert (config.max_attempts, config.log_level) == (5, "debug")
    assert config.endpoint == ["http://a:1", "http://b:2"]
    assert from_args(RouterConfig, router_args("--max-attempts", "2", *POD)).endpoint == POD[1:]


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "--endpoint (or --prefill-endpoint and --decode-endpoint) is required"),
        (["--prefill-endpoint", "http://p:1"], "P/D needs both"),
        (["--discovery", "k8s"], "--selector is required with --discovery k8s"),
        ([*POD, "--index-capacity", "0"], "--index-capacity must be >= 1"),
        ([*POD, "--scrape-interval", "0"], "--scrape-interval must be > 0"),
        ([*POD, "--failure-backoff", "-1"], "--failure-backoff must be >= 0"),
        ([*POD, "--max-pod-connections", "0"], "--max-pod-connections must be >= 1"),
        ([*POD, "--body-read-timeout", "0"], "--body-read-timeout must be > 0"),
        ([*POD, "--kv-events-max-message-bytes", "10"], "must be >= 1024"),
        ([*POD, "--processed-prompt-key", "short"], "--processed-prompt-key must be at least"),
    ],
)
def test_bad_flags_are_refused_naming_the_flag(argv, message, monkeypatch):
    monkeypatch.delenv("EPDSERVE_ENDPOINT", raising=False)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        from_args(RouterConfig, router_args(*argv))
