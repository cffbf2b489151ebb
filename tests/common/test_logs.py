"""The one logging setup: text or one JSON object per line, level and format from arguments
or the environment, no line per HTTP exchange below debug."""

from __future__ import annotations

import io
import json
import logging

import pytest

from epdserve.common.logs import JsonFormatter, setup_logging


@pytest.fixture
def restore_root():
    root = logging.getLogger()
    saved = (root.handlers[:], root.level, logging.getLogger("httpx").level)
    yield root
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])
    logging.getLogger("httpx").setLevel(saved[2])


def test_json_lines_carry_time_level_logger_and_message_only(restore_root):
    out = io.StringIO()
    setup_logging("info", "json", out)
    log = logging.getLogger("epdserve.test")
    log.debug("not shown")
    log.warning("pod %s is now %s", "a:1", "unhealthy")
    (line,) = out.getvalue().splitlines()
    entry = json.loads(line)
    assert set(entry) == {"time", "level", "logger", "message"}
    assert entry["level"] == "WARNING" and entry["logger"] == "epdserve.test"
    assert entry["message"] == "pod a:1 is now unhealthy"
    assert entry["time"].endswith("+00:00")


def test_json_keeps_a_traceback_inside_its_line(restore_root):
    out = io.StringIO()
    setup_logging("info", "json", out)
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("x").exception("request %s failed", "r1")
    (line,) = out.getvalue().splitlines()
    entry = json.loads(line)
    assert entry["message"] == "request r1 failed" and "ValueError: boom" in entry["exc"]


def test_stderr_is_the_default_stream(restore_root, capsys):
    setup_logging("info", "text")
    logging.getLogger("epdserve.test").info("hello")
    assert "INFO epdserve.test: hello" in capsys.readouterr().err


def test_a_record_about_a_kubernetes_object_names_it(restore_root):
    out = io.StringIO()
    setup_logging("info", "json", out)
    ref = {"kind": "InferencePool", "namespace": "ns", "name": "pool"}
    logging.getLogger("kopf.objects").info("reconciled", extra={"k8s_ref": ref})
    assert json.loads(out.getvalue())["object"] == "ns/pool"


def test_level_and_format_come_from_the_environment_when_unset(restore_root, monkeypatch):
    monkeypatch.setenv("EPDSERVE_LOG_LEVEL", "warning")
    monkeypatch.setenv("EPDSERVE_LOG_FORMAT", "json")
    setup_logging()
    assert restore_root.level == logging.WARNING
    assert isinstance(restore_root.handlers[0].formatter, JsonFormatter)


def test_httpx_request_lines_only_show_at_debug(restore_root):
    out = io.StringIO()
    setup_logging("info", "text", out)
    logging.getLogger("httpx").info("HTTP Request: GET http://pod/metrics")
    assert out.getvalue() == ""
    setup_logging("debug", "text", out)
    logging.getLogger("httpx").info("HTTP Request: GET http://pod/metrics")
    assert "HTTP Request" in out.getvalue()


def test_unknown_level_or_format_is_refused_by_flag_name(restore_root):
    with pytest.raises(ValueError, match="--log-level"):
        setup_logging("loud", "text")
    with pytest.raises(ValueError, match="--log-format"):
        setup_logging("info", "xml")
