"""Router logs as a process: no line per request or per scrape at INFO, optional access log,
JSON lines from every logger (the setup itself is tested in tests/common/test_logs.py)."""

from __future__ import annotations

import json

import httpx
import pytest


@pytest.fixture(scope="module")
def pod(module_spawn, models):
    return module_spawn.standin(models.get("llama"), num_blocks=24, block_size=16)


def router_log(spawn, pod, *flags: str) -> list[str]:
    """Lines the router logged while proxying one request and scraping its pod."""
    router = spawn.router([pod], "--log-level", "info", *flags)
    body = {"model": "tiny", "prompt": "hello there", "max_tokens": 2}
    assert httpx.post(router.url + "/v1/completions", json=body, timeout=30).status_code == 200
    router.stop()
    log = spawn.log_dir / f"router-{router.url.rsplit(':', 1)[1]}.log"
    return log.read_text().splitlines()


def test_info_logs_have_no_line_per_request_or_scrape(spawn, pod):
    lines = router_log(spawn, pod)
    assert any("pod 127.0.0.1" in line and "added" in line for line in lines)
    assert not [line for line in lines if "HTTP Request" in line]
    assert not [line for line in lines if "/v1/completions" in line]


def test_access_log_flag_logs_each_request(spawn, pod):
    lines = router_log(spawn, pod, "--access-log")
    assert [line for line in lines if "POST /v1/completions" in line]


def test_json_log_format_makes_every_router_line_json(spawn, pod):
    lines = router_log(spawn, pod, "--log-format", "json", "--access-log")
    entries = [json.loads(line) for line in lines]
    loggers = {e["logger"] for e in entries}
    assert {"epdserve.router.service", "uvicorn.access", "uvicorn.error"} <= loggers
