"""Router logs: no line per request or per scrape at INFO, optional access log, JSON lines."""

from __future__ import annotations

import io
import json
import logging

import httpx
import pytest

from epdserve.router.logs import setup_logging


@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    saved = (list(root.handlers), root.level, logging.getLogger("httpx").level)
    yield
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])
    logging.getLogger("httpx").setLevel(saved[2])


def test_json_format_writes_one_object_per_line(restore_logging):
    out = io.StringIO()
    setup_logging("info", "json", out)
    logging.getLogger("epdserve.router.test").warning("pod %s is now %s", "a:1", "unhealthy")
    entry = json.loads(out.getvalue().splitlines()[0])
    assert set(entry) == {"time", "level", "logger", "message"}
    assert entry["level"] == "WARNING" and entry["logger"] == "epdserve.router.test"
    assert entry["message"] == "pod a:1 is now unhealthy"
    assert entry["time"].endswith("+00:00")


def test_json_format_keeps_a_traceback_inside_its_line(restore_logging):
    out = io.StringIO()
    setup_logging("info", "json", out)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logging.getLogger("x").exception("failed")
    (line,) = out.getvalue().splitlines()
    assert "RuntimeError: boom" in json.loads(line)["exc"]


def test_httpx_request_lines_only_show_at_debug(restore_logging):
    out = io.StringIO()
    setup_logging("info", "text", out)
    logging.getLogger("httpx").info("HTTP Request: GET http://pod/metrics")
    assert out.getvalue() == ""
    setup_logging("debug", "text", out)
    logging.getLogger("httpx").info("HTTP Request: GET http://pod/metrics")
    assert "HTTP Request" in out.getvalue()


def test_unknown_level_or_format_is_rejected_by_flag_name(restore_logging):
    with pytest.raises(ValueError, match="--log-level"):
        setup_logging("loud", "text")
    with pytest.raises(ValueError, match="--log-format"):
        setup_logging("info", "xml")


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
