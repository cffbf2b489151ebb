"""Adapter-aware placement of one request (``prepare``), the adapter part of each pod's
scrape (``observe``) and the load request itself. The rules are in :mod:`lora`."""

from __future__ import annotations

import dataclasses
import json
import logging
import time

import httpx
from fastapi.responses import JSONResponse

from epdserve.router.lora import (
    LoadFailed,
    load_order,
    parse_lora_info,
    parse_models,
    split,
    spread_target,
)
from epdserve.router.pods import PodState
from epdserve.router.proxy import ProxyError
from epdserve.router.service import Router, Routing
from epdserve.router.strategy import Decision

log = logging.getLogger(__name__)


class AdapterNotFound(ProxyError):
    """No pod holds the adapter and none may load it: a pod's own answer, without a pod."""

    status = 404
    kind = "NotFoundError"
    reason = "lora_not_found"

    def response(self) -> JSONResponse:
        error = {"message": str(self), "type": self.kind, "param": "model", "code": 404}
        return JSONResponse({"error": error}, status_code=404)


class AdapterLoadFailed(ProxyError):
    """Every pod the adapter could go to failed to load it."""

    reason = "lora_load_failed"


async def prepare(client: httpx.AsyncClient, router: Router, routing: Routing) -> Routing:
    """``routing`` ordered for its adapter (unchanged for the base model), after loading the
    adapter where ``lora`` says so. Raises AdapterNotFound or AdapterLoadFailed."""
    lora = routing.lora
    if lora is None:
        return routing
    states = {d.pod: s for d in routing.order if (s := router.pod(d.pod)) is not None}
    order = list(states)
    views = {n: s.adapters for n, s in states.items()}
    loads = {n: s.load() for n, s in states.items()}
    holders, unknown, others = split(order, views, lora)
    loaded: list[str] = []
    if router.lora_policy.loadable(lora):
        fresh = [n for n in others + unknown if not router.adapter_loads.recent_failure(n, lora)]
        if holders:
            spread_load = router.lora_policy.spread_load
            target = spread_target(holders, fresh, views, loads, spread_load)
            if target is not None and await _try_load(client, router, states[target], lora):
                loaded = [target]
        else:
            loaded = await _place(client, router, states, others + unknown, lora)
    ranked = loaded + holders + [n for n in unknown if n not in loaded]
    if not ranked:
        if not order:
            return routing  # no pod at all: the proxy's 503
        raise AdapterNotFound(f"The model `{lora}` does not exist.")
    if loaded or holders:  # names pods hold: the label set stays bounded
        router.metrics.lora_requests.labels(router.engine_role, lora).inc()
    decisions = {d.pod: d for d in routing.order}
    first = [Decision(n, "lora_loaded") for n in loaded]
    return dataclasses.replace(routing, order=first + [decisions[n] for n in ranked[len(first) :]])


async def _place(client, router: Router, states: dict[str, PodState], names, lora) -> list[str]:
    """Load ``lora`` on the first of ``names`` that takes it (``load_order``); ``[pod]``, or
    ``[]`` when no pod serves adapters. Raises AdapterLoadFailed when every one failed."""
    views = {n: states[n].adapters for n in names}
    loads = {n: states[n].load() for n in names}
    errors = []
    for name in load_order(names, views, loads):
        if why := router.adapter_loads.recent_failure(name, lora):
            errors.append(f"{name}: {why}")
            continue
        try:
            await _load(client, router, states[name], lora)
            return [name]
        except LoadFailed as exc:
            errors.append(f"{name}: {exc}")
    if errors:
        raise AdapterLoadFailed(f"the adapter `{lora}` could not be loaded: {'; '.join(errors)}")
    return []


async def _try_load(client, router: Router, state: PodState, lora: str) -> bool:
    """A spread load: failing it only leaves the adapter where it is."""
    try:
        await _load(client, router, state, lora)
        return True
    except LoadFailed as exc:
        log.warning("spreading adapter %s to %s failed: %s", lora, state.name, exc)
        return False


async def _load(client, router: Router, state: PodState, lora: str) -> None:
    """Load ``lora`` on ``state``'s pod, or wait for the load in flight there."""
    policy = router.lora_policy

    async def start() -> None:
        try:
            await post_load(client, state.endpoint.url, lora, policy.sources[lora], policy)
        except LoadFailed:
            router.metrics.lora_loads.labels(lora, "failed").inc()
            raise
        router.metrics.lora_loads.labels(lora, "loaded").inc()
        state.adapters = state.adapters.with_loaded(lora)
        log.info("adapter %s loaded on %s", lora, state.name)

    await router.adapter_loads.load(state.name, lora, start)


async def post_load(client: httpx.AsyncClient, url: str, lora: str, path: str, policy) -> None:
    """``POST /v1/load_lora_adapter``; an adapter the pod has already counts as loaded.
    Raises LoadFailed with the pod's reason."""
    body = {"lora_name": lora, "lora_path": path}
    try:
        response = await client.post(
            url + "/v1/load_lora_adapter",
            json=body,
            headers=_auth(policy),
            timeout=policy.load_timeout,
        )
    except httpx.HTTPError as exc:
        raise LoadFailed(f"{type(exc).__name__}: {exc}") from exc
    if response.status_code == 200:
        return
    message = _error_message(response)
    if response.status_code == 400 and "already" in message:  # the operator, another router
        return
    raise LoadFailed(f"HTTP {response.status_code}: {message}")


def _error_message(response: httpx.Response) -> str:
    try:
        error = response.json().get("error")
        message = error.get("message") if isinstance(error, dict) else None
    except (ValueError, AttributeError):
        message = None
    return str(message) if message else response.text[:200]


def _auth(policy) -> dict[str, str]:
    return {"Authorization": f"Bearer {policy.api_key}"} if policy.api_key else {}


async def observe(
    client: httpx.AsyncClient, router: Router, state: PodState, page: str, timeout: float
) -> None:
    """The adapter part of a pod's scrape: the gauge from its /metrics ``page``, and its
    ``/v1/models`` when due (see :mod:`lora`)."""
    policy = router.lora_policy
    try:
        info = parse_lora_info(page, state.adapters.listed)
    except ValueError:  # the load part of the scrape counts a broken page
        info = None
    if info is not None:
        state.adapters = dataclasses.replace(state.adapters, max_lora=info[0], running=info[1])
    view = state.adapters
    if not (policy.configured or view.enabled):
        return
    stale = time.monotonic() - view.listed_at >= policy.list_interval
    if not stale and (not view.known or view.running <= view.listed):
        return  # a pod whose list failed is asked again after the interval
    base, listed = view.base, view.listed
    try:
        response = await client.get(
            state.endpoint.url + "/v1/models", headers=_auth(policy), timeout=timeout
        )
        response.raise_for_status()
        base, listed = parse_models(response.json())
    except (httpx.HTTPError, ValueError) as exc:
        router.metrics.scrape_errors.labels(state.name).inc()
        log.debug("model list of %s not read: %s", state.name, exc)
    now = time.monotonic()  # a load may have finished meanwhile: change only the list
    state.adapters = dataclasses.replace(state.adapters, base=base, listed=listed, listed_at=now)
    if info is not None and listed != view.listed:  # names with commas, read by the new list
        running = parse_lora_info(page, listed)[1]
        state.adapters = dataclasses.replace(state.adapters, running=running)


def with_adapters(router: Router, raw: bytes) -> bytes:
    """A pod's ``/v1/models`` answer with every adapter of the pool: those any pod lists and,
    with dynamic loading, those the router may load (a pod lists only its own)."""
    try:
        answer = json.loads(raw)
        cards = answer["data"]
        base = next(c for c in cards if isinstance(c, dict) and c.get("parent") is None)
    except (ValueError, TypeError, KeyError, StopIteration):
        return raw  # not a model list: the pod's answer as it is
    names = set().union(*(p.adapters.listed or () for p in router.pods()))
    if router.lora_policy.dynamic:
        names |= set(router.lora_policy.sources)
    present = {c.get("id") for c in cards if isinstance(c, dict)}
    for name in sorted(names - present):
        card = {**base, "id": name, "parent": base["id"], "max_model_len": None}
        cards.append({**card, "root": router.lora_policy.sources.get(name, name)})
    return json.dumps(answer).encode()
