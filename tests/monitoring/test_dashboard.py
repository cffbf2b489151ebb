"""The chart's Grafana dashboard and alert rules against a real Prometheus scraping a real pool.

A prefill pod, a decode pod (real `epdserve serve` processes sharing a real redis-server) and
a real router serve a few requests; a real Prometheus scrapes them with exactly the target
labels the operator's ServiceMonitor gives them under prometheus-operator (derived from the
built objects, not written by hand). Every dashboard expression, every alert expression and
the operator's KEDA queries are then evaluated through Prometheus's HTTP API and must return
data.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import yaml
from ipool_samples import ROOT, example
from monitor_targets import monitor_targets, service_monitor
from prometheus_support import PrometheusServer, finite_points
from serving_support import ServerProcess, free_port, wait_ready

from epdserve.operator.desired import desired_objects
from epdserve.operator.scalers import prometheus_query
from epdserve.operator.spec import parse_pool

CHART = ROOT / "charts" / "epdserve"
DASHBOARD = json.loads((CHART / "files" / "grafana-dashboard.json").read_text())
RULES = CHART / "files" / "prometheus-rules.yaml"
POOL = example("pd-redis")  # the shipped P/D example: it enables the pool's ServiceMonitor
SCRAPE_S = 1
# Grafana's $__rate_interval: max($__interval + scrape interval, 4 x scrape interval), where
# $__interval is the query step (one scrape interval here)
RATE_INTERVAL = f"{max(SCRAPE_S + SCRAPE_S, 4 * SCRAPE_S)}s"
WORDS = ["alpha", "beta", "gamma", "delta", "kernel", "tensor", "block", "cache", "query"]


class RouterProcess:
    """The real `epdserve router` in front of the pool's prefill and decode pods."""

    def __init__(self, model: str, prefill: ServerProcess, decode: ServerProcess):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "epdserve.engine.cli", "router", "--port", str(self.port)]
        cmd += ["--model", model, "--served-model-name", "tiny", "--log-level", "warning"]
        cmd += ["--prefill-endpoint", prefill.endpoint, "--decode-endpoint", decode.endpoint]
        self.proc = subprocess.Popen(cmd, start_new_session=True)
        try:
            wait_ready(self.url, self.proc, 60)
        except RuntimeError:
            self.stop()
            raise

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(15)


def engine_pod(model: str, role: str, redis_url: str) -> ServerProcess:
    """An engine pod of `role` with KV events on (so the router indexes its blocks)."""
    events, replay = free_port(), free_port()
    kv_role = {"prefill": "kv_producer", "decode": "kv_consumer"}[role]
    transfer = {"kv_connector": "RedisConnector", "kv_role": kv_role}
    transfer["kv_connector_extra_config"] = {"url": redis_url}
    config = {"enable_kv_cache_events": True, "publisher": "zmq"}
    config |= {"endpoint": f"tcp://*:{events}", "replay_endpoint": f"tcp://*:{replay}"}
    pod = ServerProcess(
        model,
        *("--role", role, "--hash-seed", POOL["spec"]["hashSeed"]),
        *("--kv-transfer-config", json.dumps(transfer)),
        *("--kv-events-config", json.dumps(config)),
        api_key=None,
    )
    pod.endpoint = f"{pod.url},events={events},replay={replay}"
    return pod


def drive_load(url: str, requests: range) -> None:
    """Completions and chat, streamed and not, two at a time; prompts share two prefixes, so
    prefix-cache hits (local on the prefill pod, from Redis on the decode pod) happen."""
    rng = random.Random(19)
    prefixes = [" ".join(rng.choice(WORDS) for _ in range(60)) for _ in range(2)]

    def one(i: int) -> None:
        suffix = random.Random(i).choices(WORDS, k=8)
        text = prefixes[i % 2] + " " + " ".join(suffix)
        body = {"model": "tiny", "max_tokens": 8, "ignore_eos": True, "stream": i % 3 == 0}
        if i % 4 == 3:
            path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": text}]
        else:
            path, body["prompt"] = "/v1/completions", text
        with httpx.stream("POST", url + path, json=body, timeout=60) as resp:
            resp.read()
            assert resp.status_code == 200, resp.text

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(one, requests))


@pytest.fixture(scope="module")
def scraped_pool(models, redis_server, tmp_path_factory):
    """(prometheus, start, end): the pool served load between start and end, and Prometheus
    scraped every target before and after it."""
    if redis_server.proc is None or redis_server.proc.poll() is not None:
        redis_server.start()
    redis_url = redis_server.url
    objects = desired_objects(parse_pool(POOL))
    targets = monitor_targets(service_monitor(objects), objects)
    model = str(models.get("llama"))
    name = POOL["metadata"]["name"]
    processes, prom = [], None
    try:
        with ThreadPoolExecutor(2) as pool:  # both pods start at once
            starting = [pool.submit(engine_pod, model, r, redis_url) for r in ("prefill", "decode")]
        for future in starting:  # every started pod is stopped, even if the other failed
            if future.exception() is None:
                processes.append(future.result())
        prefill, decode = (future.result() for future in starting)
        router = RouterProcess(model, prefill, decode)
        processes.append(router)
        by_deployment = {f"{name}-prefill": prefill, f"{name}-decode": decode}
        by_deployment[f"{name}-router"] = router
        assert {t.deployment for t in targets} == set(by_deployment)
        static = [
            {"targets": [by_deployment[t.deployment].url.removeprefix("http://")]}
            | {"labels": dict(t.labels)}
            for t in targets
        ]
        workdir = tmp_path_factory.mktemp("prometheus")
        prom = PrometheusServer(workdir, static, rule_files=[RULES], interval_s=SCRAPE_S)
        prom.wait_for(f"count(up == 1) == {len(targets)}", "every target up")
        start = time.time()
        for first in (0, 8):  # two rounds, each followed by a scrape of every target
            drive_load(router.url, range(first, first + 8))
            after = f"count(timestamp(up == 1) > {time.time() + SCRAPE_S}) == {len(targets)}"
            prom.wait_for(after, "two successful scrapes of every target after the load")
        yield prom, start - 2 * SCRAPE_S, time.time()
    finally:
        if prom is not None:
            prom.stop()
        for proc in reversed(processes):
            proc.stop()


def grafana_format(values: list[str]) -> str:
    """A multi-value variable set to All, as Grafana writes it into a Prometheus query."""
    escaped = [re.sub(r"([\\^$.|?*+()\[\]{}])", r"\\\\\1", v) for v in values]
    return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"


def substitute(expr: str, variables: dict[str, str]) -> str:
    for name, value in variables.items():
        expr = expr.replace("${" + name + "}", value).replace("$" + name, value)
    return expr


def template_variables(prom: PrometheusServer, start: float, end: float) -> dict[str, str]:
    """Resolve the dashboard's query variables (`label_values(...)`) in order, as Grafana."""
    variables = {"__rate_interval": RATE_INTERVAL}
    for var in DASHBOARD["templating"]["list"]:
        if var["type"] != "query":
            continue
        match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", var["query"])
        assert match, f"variable {var['name']}: unsupported query {var['query']!r}"
        selector = substitute(match.group(1), variables)
        params = {"match[]": selector, "start": start, "end": end}
        values = prom.api(f"label/{match.group(2)}/values", **params)
        assert values, f"variable ${var['name']} ({var['query']}) has no values"
        variables[var["name"]] = grafana_format(values)
    return variables


def panel_targets():
    for panel in DASHBOARD["panels"]:
        for target in panel.get("targets", []):
            yield f"{panel['title']!r} [{target['refId']}]", target["expr"]


def grouping_labels(expr: str) -> set[str]:
    """Labels the query groups by (`le` is consumed by histogram_quantile)."""
    found = re.findall(r"\bby\s*\(([^)]*)\)", expr)
    return {name.strip() for group in found for name in group.split(",")} - {"le", ""}


def problems(result: list[dict], expr: str) -> str | None:
    """Why a query result would leave a panel empty or mislabelled, or None."""
    if finite_points(result) == 0:
        return "no data"
    unlabelled = {k for s in result for k in grouping_labels(expr) if not s["metric"].get(k)}
    return f"series without {sorted(unlabelled)}" if unlabelled else None


def test_every_dashboard_panel_shows_data_from_a_scraped_pd_pool(scraped_pool):
    prom, start, end = scraped_pool
    variables = template_variables(prom, start, end)
    failures, roles = [], {}
    for where, expr in panel_targets():
        query = substitute(expr, variables)
        assert "$" not in query, f"{where}: unresolved variable in {query}"
        result = prom.query_range(query, start, end)
        if (why := problems(result, query)) is not None:
            failures.append(f"{where}: {why}: {query}")
        if "role" in grouping_labels(query):
            roles[where] = {s["metric"].get("role") for s in result}
    assert not failures, "panels that would be empty or mislabelled:\n" + "\n".join(failures)
    assert roles and all(seen >= {"prefill", "decode"} for seen in roles.values()), roles


def rule_queries() -> list[tuple[str, str]]:
    """(rule, the query an alert compares with its threshold, or a recording rule's expr)."""
    out = []
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            expr = " ".join(rule["expr"].split())
            if "alert" in rule:
                match = re.fullmatch(r"(.+?)\s*(==|!=|>=|<=|>|<)\s*[0-9.e+-]+", expr)
                assert match, f"{rule['alert']}: not `<query> <comparison> <threshold>`"
                expr = match.group(1)
            out.append((rule.get("alert") or rule["record"], expr))
    return out


def test_every_alert_rule_query_returns_data_and_prometheus_evaluates_the_rules(scraped_pool):
    prom, _, end = scraped_pool
    failures = [
        f"{name}: {why}: {query}"
        for name, query in rule_queries()
        if (why := problems(prom.query(query, end), query)) is not None
    ]
    assert not failures, "rule queries without data:\n" + "\n".join(failures)
    groups = prom.api("rules")["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert len(rules) == len(rule_queries())
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
    firing = [r["name"] for r in rules if r["state"] != "inactive"]
    assert firing == [], "a healthy pool under light load fires alerts"


@pytest.mark.parametrize("metric", ["waiting", "kvCacheUsage", "ttftP90"])
def test_the_operators_keda_queries_return_data_for_each_role(scraped_pool, metric):
    prom, _, end = scraped_pool
    pool = parse_pool(POOL)
    for role in ("prefill", "decode"):
        query, _ = prometheus_query(pool, role, metric)
        assert problems(prom.query(query, end), query) is None, (role, query)


def test_collapsed_row_queries_are_valid_promql(scraped_pool):
    """Rows for optional features (LoRA, tenants) may have no data on this pool, but each
    of their queries must evaluate: a typo would otherwise only show in a user's Grafana."""
    prom, start, end = scraped_pool
    variables = template_variables(prom, start, end)
    rows = [p for p in DASHBOARD["panels"] if p["type"] == "row"]
    assert {r["title"] for r in rows} >= {"LoRA adapters", "Tenants"}
    for row in rows:
        for panel in row["panels"]:
            for target in panel["targets"]:
                prom.query(substitute(target["expr"], variables), end)  # asserts success
