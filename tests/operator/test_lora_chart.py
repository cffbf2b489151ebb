"""The chart's LoRA parts: its CRD copy carries `spec.lora` and `status.lora`, and the rendered
dashboard has the LoRA row (adapters per pod from `vllm:lora_requests_info`, requests per
adapter from `epdserve:lora_requests_total`)."""

from __future__ import annotations

import json
import re

import yaml
from test_chart import CHART, render


def test_the_charts_crd_declares_spec_lora_and_status_lora():
    crd = yaml.safe_load((CHART / "crds" / "inferencepool.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
    lora = schema["spec"]["properties"]["lora"]["properties"]
    assert set(lora) == {"adapters", "maxLoras", "maxRank", "dynamic"}
    assert (lora["maxRank"]["minimum"], lora["maxRank"]["maximum"]) == (1, 512)
    sources = lora["adapters"]["items"]["properties"]["source"]["properties"]
    assert set(sources) == {"huggingFace", "pvc", "path"}
    role = schema["status"]["properties"]["lora"]["additionalProperties"]["properties"]
    assert set(role) == {"adapters", "errors"}


def lora_panels() -> list[dict]:
    (cm,) = [d for d in render({}) if d["kind"] == "ConfigMap"]
    dashboard = json.loads(cm["data"]["epdserve.json"])
    (row,) = [p for p in dashboard["panels"] if p["type"] == "row" and "LoRA" in p["title"]]
    ids = [p["id"] for p in dashboard["panels"]] + [p["id"] for p in row["panels"]]
    assert len(set(ids)) == len(ids)
    return row["panels"]


def test_the_dashboard_shows_adapters_per_pod_and_requests_per_adapter():
    exprs = {p["title"]: p["targets"][0]["expr"] for p in lora_panels()}
    info = exprs["LoRA adapters per pod"]
    assert re.search(r"by \(pod, max_lora, running_lora_adapters, waiting_lora_adapters\)", info)
    assert "vllm:lora_requests_info{" in info
    rate = exprs["LoRA requests per adapter"]
    assert rate.startswith("sum by (lora_name) (rate(epdserve:lora_requests_total{")
    for expr in exprs.values():
        assert 'namespace=~"$namespace", pool=~"$pool"' in expr
