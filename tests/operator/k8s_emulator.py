"""A Kubernetes API emulator for operator tests: kmock's emulator, extended (DESIGN.md §6).

`ApiEmulator` keeps kmock's server, discovery, request journal and reaction DSL (used here to
inject faults), and replaces its object semantics with what kopf and the official client
need: uid / resourceVersion / generation / creationTimestamp, 201 on create, PUT,
merge / JSON / strategic(≈merge) / server-side-apply patches with resourceVersion
preconditions (409) and JSON-patch `test` (422), status subresources, label and field
selectors, watches that resume from a resourceVersion (410 once compacted), finalizers,
owner-reference garbage collection, and CRDs that become served resources when created.

`EmulatorThread` runs one on a free loopback port in a background thread and writes a
kubeconfig for it, so tests stay synchronous. Integration tests of the operator run on the
real control plane (real_cluster.py); the emulator serves the fault tests (test_faults.py)
and the unit tests that need an API to list from.
"""

from __future__ import annotations

import asyncio
import copy
import json

import attrs
import kmock
import yaml
from k8s_patch import PatchError, json_patch, match_fields, match_labels, merge_patch
from k8s_patch import server_side_apply as ssa
from k8s_store import ObjectStore, api_error, resource_key, status_body
from kmock._internal import parsing as kmock_parsing

NAMESPACES = "/v1/namespaces"


def _parse_path(path: str, _parse=kmock_parsing.parse_path):
    # kmock 0.8 fails on /api/v1/namespaces[/NAME] (it reads them as a namespace prefix);
    # a real server serves the Namespace objects there.
    parts = path.strip("/").split("/")
    if parts[:3] == ["api", "v1", "namespaces"] and len(parts) <= 4:
        name = parts[3] if len(parts) == 4 else None
        return kmock_parsing.ParsedPath("", "v1", "namespaces", None, name, None)
    return _parse(path)


kmock_parsing.parse_path = _parse_path  # patched once, at import (test support code only)


@attrs.define(kw_only=True)
class ApiEmulator(ObjectStore, kmock.KubernetesEmulator):
    """kmock's KubernetesEmulator with the semantics a real API server has (see module doc)."""

    store: dict = attrs.field(factory=dict, init=False)  # (res key, ns, name) -> object
    history: list = attrs.field(factory=list, init=False)  # (rv, res key, event type, object)
    revision: int = attrs.field(default=0, init=False)
    compacted: int = attrs.field(default=0, init=False)  # watches from before this get 410
    _waiters: set = attrs.field(factory=set, init=False)  # one asyncio.Event per open watch
    _epoch: int = attrs.field(default=0, init=False)  # bumped to cut every open watch
    journal_limit: int = 64  # requests kept in kmock's journal (`emulator.requests`)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.fallback[kmock.method.PUT] << self._serve_replace
        self.resources.load_bundled()
        for namespace in ("default", "kube-system"):  # what every cluster starts with
            self.create(
                NAMESPACES,
                None,
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
            )

    async def _handle(self, request):
        # kmock checks each reaction against its whole request journal (quadratic over a
        # test); keep the recent requests only. Faults count their own hits (see `fail`).
        del self._requests[: -self.journal_limit]
        # Skip kmock's own in-place object bookkeeping: every change happens in the _serve_*
        # fallbacks below, so a fault injected by a reaction leaves the state untouched.
        return await super(kmock.KubernetesEmulator, self)._handle(request)

    # -- fault injection -----------------------------------------------------------------

    def fail(self, method, resource, status, times=1, subresource=None, watch=False):
        """Answer the next `times` matching requests with an error, via kmock's DSL.

        `subresource` ("status") or `watch=True` narrow the match further.
        """
        criteria = [kmock.method(method.upper()), kmock.resource(resource)]
        if subresource:
            criteria.append(kmock.subresource(subresource))
        if watch:
            criteria.append(kmock.action.WATCH)
        reason = {409: "Conflict", 429: "TooManyRequests"}.get(status, "InternalError")
        left = [times]

        def respond():
            if left[0] <= 0:
                return NotImplemented  # spent: kmock disables this reaction, fallbacks serve
            left[0] -= 1
            return kmock.Response(status=status, payload=status_body(status, reason))

        return self[tuple(criteria)] << respond

    # -- HTTP handlers -------------------------------------------------------------------

    def _resolve(self, request) -> tuple[str, str | None]:
        res = resource_key(request.resource)
        info = self._info(res)
        if info is None:
            raise api_error(404, "NotFound", f"the server could not find the resource {res}")
        return res, request.namespace if info.namespaced is not False else None

    def _matches(self, request, res, namespace, key, obj) -> bool:
        return (
            key[0] == res
            and (namespace is None or key[1] == namespace)
            and (request.name is None or key[2] == request.name)
            and match_labels(request.params.get("labelSelector"), obj["metadata"].get("labels"))
            and match_fields(request.params.get("fieldSelector"), obj)
        )

    async def _serve_list(self, request):
        res, namespace = self._resolve(request)
        items = [
            copy.deepcopy(obj)
            for key, obj in sorted(self.store.items(), key=lambda kv: (kv[0][1] or "", kv[0][2]))
            if self._matches(request, res, namespace, key, obj)
        ]
        kind = (self._info(res).kind or "") + "List"
        group, version, _ = res.split("/")
        api_version = f"{group}/{version}" if group else version
        meta = {"resourceVersion": str(self.revision)}
        return {"apiVersion": api_version, "kind": kind, "metadata": meta, "items": items}

    async def _serve_watch(self, request):
        res, namespace = self._resolve(request)
        yield b""  # send the headers now, even if nothing happens for a while
        since = request.params.get("resourceVersion") or ""
        if since and int(since) < self.compacted:
            yield {"type": "ERROR", "object": status_body(410, "Expired", "too old")}
            return
        position = len(self.history)
        if not since or since == "0":  # no version: the current state first, as ADDED
            for key, obj in list(self.store.items()):
                if self._matches(request, res, namespace, key, obj):
                    yield {"type": "ADDED", "object": copy.deepcopy(obj)}
        else:
            position = next((i for i, h in enumerate(self.history) if h[0] > int(since)), position)
        timeout = float(request.params.get("timeoutSeconds") or 3600)
        deadline = asyncio.get_running_loop().time() + timeout
        epoch, waiter = self._epoch, asyncio.Event()
        self._waiters.add(waiter)
        try:
            while epoch == self._epoch:
                while position < len(self.history):  # re-read: events may land while we yield
                    _, key, etype, obj = self.history[position]
                    position += 1
                    meta = obj["metadata"]
                    where = (key, meta.get("namespace"), meta["name"])
                    if self._matches(request, res, namespace, where, obj):
                        yield {"type": etype, "object": obj}
                waiter.clear()
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0:
                    return
                try:
                    await asyncio.wait_for(waiter.wait(), left)
                except TimeoutError:
                    return
        finally:
            self._waiters.discard(waiter)

    async def _serve_fetch(self, request):
        res, namespace = self._resolve(request)
        obj = self.store.get((res, namespace, request.name))
        if obj is None:
            raise api_error(404, "NotFound", f"{res} {request.name!r} not found")
        return copy.deepcopy(obj)

    async def _serve_create(self, request):
        res, namespace = self._resolve(request)
        body = request.data if isinstance(request.data, dict) else {}
        return kmock.Response(status=201, payload=self.create(res, namespace, body))

    async def _serve_replace(self, request):
        res, namespace = self._resolve(request)
        body = request.data if isinstance(request.data, dict) else {}
        status = request.subresource == "status"
        return copy.deepcopy(self.update(res, namespace, request.name, body, status))

    async def _serve_update(self, request):
        res, namespace = self._resolve(request)
        headers = {k.lower(): v for k, v in request.headers.items()}
        ctype = (headers.get("content-type") or "").split(";")[0].strip()
        status = request.subresource == "status"
        live = self.store.get((res, namespace, request.name))
        try:
            if ctype == "application/apply-patch+yaml":
                applied = yaml.safe_load(request.text)
                if live is None:
                    return kmock.Response(status=201, payload=self.create(res, namespace, applied))
                new = ssa(live, applied)
            elif live is None:
                raise api_error(404, "NotFound", f"{res} {request.name!r} not found")
            elif ctype == "application/json-patch+json":
                new = json_patch(live, json.loads(request.text))
            else:  # merge-patch+json; strategic-merge-patch+json approximated as merge
                new = merge_patch(live, json.loads(request.text))
        except PatchError as exc:
            raise api_error(422, "Invalid", str(exc)) from exc
        if new["metadata"].get("resourceVersion") == live["metadata"].get("resourceVersion"):
            new["metadata"].pop("resourceVersion", None)  # untouched: no precondition asked
        return copy.deepcopy(self.update(res, namespace, request.name, new, status))

    async def _serve_delete(self, request):
        res, namespace = self._resolve(request)
        body = request.data if isinstance(request.data, dict) else {}
        orphan = body.get("propagationPolicy") == "Orphan"
        return copy.deepcopy(self.delete(res, namespace, request.name, orphan))
