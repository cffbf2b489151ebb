"""`epdserve operator` as a process: flags, and a real run against the emulator."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys

from ipool_samples import ROOT, pool_body
from k8s_cluster import kubectl, wait_for

from epdserve.operator import cli


def test_flags_parse_with_defaults_from_the_environment(monkeypatch):
    monkeypatch.setenv("EPDSERVE_WATCH_NAMESPACES", "a,b")
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--resync-seconds", "5", "-n", "c"])
    assert args.namespace == ["a", "b", "c"] and args.resync_seconds == 5.0


def test_log_flags_parse_and_unset_ones_are_left_to_the_environment():
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--log-format", "json", "--verbose"])
    assert (args.log_format, args.log_level, args.verbose) == ("json", None, True)


def test_epdserve_operator_reconciles_a_pool_and_logs_json_lines(api, tmp_path):
    kubectl(api.kubeconfig, "apply", "--validate=false", "-f", str(ROOT / "crds"))
    env = dict(os.environ, KUBECONFIG=str(api.kubeconfig), PYTHONUNBUFFERED="1")
    code = "import sys; from epdserve.engine.cli import main; sys.exit(main())"
    log = open(tmp_path / "operator.log", "w")  # noqa: SIM115  (closed below)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            code,
            "operator",
            "-n",
            "default",
            "--liveness",
            "",
            "--log-format",
            "json",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=tmp_path,
    )
    try:
        pool = tmp_path / "pool.yaml"
        body = pool_body("cli-pool")
        body["metadata"] = {"name": "cli-pool", "namespace": "default"}
        pool.write_text(__import__("yaml").safe_dump(body))
        kubectl(api.kubeconfig, "apply", "--validate=false", "-f", str(pool))
        wait_for(
            lambda: ("apps/v1/deployments", "default", "cli-pool-colocated") in api.emulator.store,
            what="the operator's Deployment",
        )
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
            log.close()
    text = (tmp_path / "operator.log").read_text()
    assert proc.returncode == 0, text[-3000:]
    entries = [json.loads(line) for line in text.splitlines()]  # every line is one object
    assert any(e["logger"].startswith("kopf") for e in entries), text[-3000:]
