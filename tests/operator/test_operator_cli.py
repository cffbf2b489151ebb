"""`epdserve operator`: its flags, and the log of the process the real cluster runs."""

from __future__ import annotations

import argparse
import json

from ipool_samples import pool_body
from k8s_cluster import NS, wait_for

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


def test_the_operator_process_logs_one_json_object_per_line(cluster, make_pool):
    # The session's operator is `epdserve operator --namespace default --log-format json`.
    make_pool(pool_body("cli-pool"))
    wait_for(lambda: cluster.apps.read_namespaced_deployment("cli-pool-colocated", NS))

    def entries():
        lines = cluster.operator_log.read_text().splitlines()
        return [json.loads(line) for line in lines]  # every line is one object

    found = wait_for(
        lambda: [e for e in entries() if e.get("object") == f"{NS}/cli-pool"], what="pool lines"
    )
    assert any(e["logger"].startswith("kopf") for e in found)
    assert {"time", "level", "logger", "message"} <= set(found[0])
