"""The tenant check and gate as ASGI layers around an echo app: which tenant a request
gets, what reaches the pods (authorization, priority), and the 400/401 answers."""

from __future__ import annotations

import asyncio
import json

import httpx
from fastapi import FastAPI, Request

from epdserve.router.guard import BodyLimit, TenantCheck
from epdserve.router.metrics import RouterMetrics
from epdserve.router.tenant_gate import GateSettings, Tenancy, add_gate, with_priority
from epdserve.router.tenants import Identity, TenantTable

TABLE = TenantTable.parse(
    {
        "tenants": [
            {"name": "gold", "weight": 4, "priority": -5, "keys": ["sk-gold"]},
            {"name": "silver", "weight": 2},  # named by the gateway header, no priority
        ]
    }
)


def echo_app(identity: Identity, gate: GateSettings) -> FastAPI:
    app = FastAPI()
    metrics = RouterMetrics()

    @app.post("/v1/completions")
    async def echo(request: Request):
        tenant = request.scope["state"]["tenant"]
        return {
            "tenant": tenant.name,
            "body": json.loads(await request.body()),
            "authorization": request.headers.get("authorization"),
        }

    app.state.queue = add_gate(app, Tenancy(identity, gate), metrics.registry, lambda: 1)
    app.add_middleware(BodyLimit, max_bytes=1 << 20, metrics=metrics)
    app.add_middleware(TenantCheck, identity=identity, metrics=metrics)
    app.state.metrics = metrics
    return app


def post(app: FastAPI, headers: dict, body: dict | None = None) -> httpx.Response:
    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            return await client.post("/v1/completions", json=body or {"p": 1}, headers=headers)

    return asyncio.run(run())


def test_a_tenant_key_becomes_the_shared_key_upstream_and_sets_its_priority():
    settings = GateSettings(2, set_priority=True, admission_header=True)
    app = echo_app(Identity(TABLE, api_key=b"shared"), settings)
    r = post(app, {"Authorization": "Bearer sk-gold"}, {"prompt": "x", "priority": 9})
    assert r.json() == {
        "tenant": "gold",
        "body": {"prompt": "x", "priority": -5},  # the client cannot raise its own
        "authorization": "Bearer shared",
    }
    assert r.headers["x-epdserve-admission"] == "1"


def test_without_a_shared_key_the_tenant_key_is_not_forwarded():
    app = echo_app(Identity(TABLE), GateSettings(0))
    r = post(app, {"Authorization": "Bearer sk-gold", "X-Tenant-Id": "bronze"})
    assert r.json()["authorization"] is None and r.json()["tenant"] == "gold"
    assert "x-epdserve-admission" not in r.headers  # no queue: no ordinal


def test_priority_and_the_admission_header_are_left_alone_unless_asked():
    app = echo_app(Identity(TABLE), GateSettings(1))
    r = post(app, {"Authorization": "Bearer sk-gold"}, {"priority": 3})
    assert r.json()["body"] == {"priority": 3}
    assert "x-epdserve-admission" not in r.headers


def test_with_tenant_priority_no_tenant_chooses_its_own_priority():
    """Configured, header-named and default tenants alike: the router's priority or 0."""
    identity = Identity(TABLE, header=b"x-tenant-id", api_key=b"shared")
    app = echo_app(identity, GateSettings(1, set_priority=True))
    shared, greedy = {"Authorization": "Bearer shared"}, {"prompt": "x", "priority": -1000}
    for header, tenant in [
        ({}, "default"),
        ({"X-Tenant-Id": "silver"}, "silver"),
        ({"X-Tenant-Id": "batch-7"}, "batch-7"),
    ]:
        r = post(app, {**shared, **header}, greedy).json()
        assert (r["tenant"], r["body"]) == (tenant, {"prompt": "x", "priority": 0})
    gold = post(app, {"Authorization": "Bearer sk-gold"}, greedy).json()
    assert gold["body"]["priority"] == -5


def test_the_header_cannot_name_a_tenant_that_has_keys():
    app = echo_app(Identity(TABLE, header=b"x-tenant-id", api_key=b"shared"), GateSettings(1))
    r = post(app, {"Authorization": "Bearer shared", "X-Tenant-Id": "gold"})
    assert r.status_code == 403 and r.json()["error"]["type"] == "PermissionDeniedError"
    text = app.state.metrics.render().decode()
    assert 'request_failures_total{reason="keyed_tenant_header"} 1.0' in text
    assert "gold" not in text  # refused before the gate counted it


def test_the_trusted_header_names_the_tenant_and_a_bad_one_is_a_400():
    app = echo_app(Identity(TABLE, header=b"x-tenant-id", api_key=b"shared"), GateSettings(1))
    auth = {"Authorization": "Bearer shared"}
    assert post(app, {**auth, "X-Tenant-Id": "team-7"}).json()["tenant"] == "team-7"
    bad = post(app, {**auth, "X-Tenant-Id": "../../etc"})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "BadRequestError"
    assert post(app, {"X-Tenant-Id": "team-7"}).status_code == 401


def test_admitted_requests_are_counted_per_tenant():
    app = echo_app(Identity(TABLE, api_key=b"shared"), GateSettings(1))
    for key in ("sk-gold", "shared", "shared"):
        assert post(app, {"Authorization": f"Bearer {key}"}).status_code == 200
    text = app.state.metrics.render().decode()
    assert 'epdserve_router:tenant_requests_admitted_total{tenant="gold"} 1.0' in text
    assert 'epdserve_router:tenant_requests_admitted_total{tenant="default"} 2.0' in text


def test_with_priority_leaves_bodies_it_cannot_read_alone():
    assert with_priority(b"not json", 1) == b"not json"
    assert with_priority(b"[1]", 1) == b"[1]"
    assert json.loads(with_priority(b'{"a": 1}', -2)) == {"a": 1, "priority": -2}
