"""Server-side `Table` output for custom resources, from their CRD's printer columns, so that
`kubectl get ipool` against the emulator prints Phase / Ready / Endpoint / Age as a cluster
would. Built-in kinds keep kubectl's client-side fallback (NAME, AGE)."""

from __future__ import annotations

import datetime

CRDS = "apiextensions.k8s.io/v1/customresourcedefinitions"


def printer_columns(store: dict, res: str) -> list[dict] | None:
    """The additionalPrinterColumns of the served version of resource key `res`, if any."""
    group, version, plural = res.split("/")
    for (kind, _, _), crd in store.items():
        spec = crd.get("spec") or {}
        if kind != CRDS or spec.get("group") != group or spec["names"]["plural"] != plural:
            continue
        for served in spec.get("versions") or []:
            if served["name"] == version:
                return served.get("additionalPrinterColumns") or None
    return None


def _lookup(obj, json_path: str):
    for part in json_path.strip(".").split("."):
        if not isinstance(obj, dict):
            return None
        obj = obj.get(part)
    return obj


def human_age(timestamp: str | None, now: datetime.datetime) -> str:
    """`5s`, `3m12s`, `2h`, `4d` — the way kubectl shows ages."""
    if not timestamp:
        return "<unknown>"
    then = datetime.datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    seconds = max(0, int((now - then).total_seconds()))
    if seconds < 120:
        return f"{seconds}s"
    minutes, hours = seconds // 60, seconds // 3600
    if minutes < 10:
        return f"{minutes}m{seconds % 60}s"
    if hours < 3:
        return f"{minutes}m"
    if hours < 48:
        return f"{hours}h"
    return f"{hours // 24}d"


def as_table(columns: list[dict], objects: list[dict], resource_version: str) -> dict:
    """A meta.k8s.io/v1 Table of `objects` with a Name column and the printer columns."""
    now = datetime.datetime.now(datetime.UTC)
    definitions = [{"name": "Name", "type": "string", "format": "name", "priority": 0}]
    definitions += [
        {
            "name": c["name"],
            "type": c.get("type", "string"),
            "format": c.get("format", ""),
            "description": c.get("description", ""),
            "priority": c.get("priority", 0),
        }
        for c in columns
    ]
    rows = []
    for obj in objects:
        cells = [obj["metadata"]["name"]]
        for column in columns:
            value = _lookup(obj, column["jsonPath"])
            if column.get("type") == "date":
                value = human_age(value, now)
            cells.append("" if value is None else value)
        partial = {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1"}
        rows.append({"cells": cells, "object": {**partial, "metadata": obj["metadata"]}})
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": resource_version},
        "columnDefinitions": definitions,
        "rows": rows,
    }


def wants_table(headers: dict) -> bool:
    """Whether the client (kubectl get) asked for a Table."""
    accept = next((v for k, v in headers.items() if k.lower() == "accept"), "")
    return "as=Table" in accept
