"""The dashboard's LoRA row against a real Prometheus scraping a real `epdserve serve` that
served two adapters: both panels' queries return series with the labels they group by.
(test_dashboard.py checks the top-level panels on a pool without adapters; the LoRA panels sit
in a collapsed row.) Slow: an engine start."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from ipool_samples import ROOT
from prometheus_support import PrometheusServer
from serving_support import ServerProcess

DASHBOARD = json.loads((ROOT / "charts/epdserve/files/grafana-dashboard.json").read_text())
LABELS = {"namespace": "default", "pool": "lora-pool", "pod": "lora-pool-0", "role": "colocated"}


def lora_targets() -> dict[str, str]:
    (row,) = [p for p in DASHBOARD["panels"] if p["type"] == "row" and "LoRA" in p["title"]]
    return {p["title"]: p["targets"][0]["expr"] for p in row["panels"]}


def resolved(expr: str) -> str:
    for name in ("namespace", "pool"):
        expr = expr.replace("$" + name, LABELS[name])
    return expr.replace("$__rate_interval", "4s")


@pytest.mark.slow
def test_the_lora_panels_show_the_adapters_a_real_pod_served(tmp_path):
    from epdserve.engine.make_model import make_model

    model = make_model("llama", tmp_path / "m", seed=5, lora=2)
    modules = [f"ad{i}={model}/loras/lora{i}" for i in range(2)]
    flags = ["--enable-lora", "--max-loras", "2", "--dtype", "float32"]
    flags += [x for m in modules for x in ("--lora-modules", m)]
    pod = ServerProcess(str(model), *flags, api_key=None)
    prom = None
    try:
        static = [{"targets": [pod.url.removeprefix("http://")], "labels": LABELS}]
        (tmp_path / "prom").mkdir()
        prom = PrometheusServer(tmp_path / "prom", static, interval_s=1)
        prom.wait_for("up == 1", "the pod scraped")
        for _ in range(2):  # a scrape between rounds: rate() needs an increase it saw
            for i in range(4):
                body = {"model": f"ad{i % 2}", "prompt": "hello there", "max_tokens": 2}
                answer = httpx.post(pod.url + "/v1/completions", json=body, timeout=60)
                assert answer.status_code == 200, answer.text
            after = f"count(timestamp(up == 1) > {time.time() + 1})"
            prom.wait_for(after, "a scrape after the round")
        exprs = lora_targets()
        rate = prom.query(resolved(exprs["LoRA requests per adapter"]))
        assert {s["metric"].get("lora_name") for s in rate} == {"ad0", "ad1"}
        assert all(float(s["value"][1]) > 0 for s in rate)
        info = prom.query(resolved(exprs["LoRA adapters per pod"]))
        assert info and {s["metric"]["pod"] for s in info} == {"lora-pool-0"}
        assert {s["metric"]["max_lora"] for s in info} == {"2"}
    finally:
        if prom is not None:
            prom.stop()
        pod.stop()
