"""A Kubernetes API emulator for operator tests: kmock's emulator, extended (DESIGN.md §6).

`ApiEmulator` keeps kmock's server, discovery, request journal and reaction DSL (used here to
inject faults), and replaces its object semantics with what kopf, kubectl and the official
client need: uid / resourceVersion / generation / creationTimestamp, 201 on create, PUT,
merge / JSON / strategic(≈merge) / server-side-apply patches with resourceVersion
preconditions (409) and JSON-patch `test` (422), status subresources, label and field
selectors, watches that resume from a resourceVersion (410 once compacted), finalizers,
owner-reference garbage collection, and CRDs that become served resources when created.

`EmulatorThread` runs one on a free loopback port in a background thread and writes a
kubeconfig for it, so tests (and the e2e harness, which plays Deployment controller and
kubelet against it) stay synchronous.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import json
import uuid

import attrs
import kmock
import yaml
from k8s_patch import PatchError, json_patch, match_fields, match_labels, merge_patch
from k8s_patch import server_side_apply as ssa
from kmock._internal import parsing as kmock_parsing

CRDS = "apiextensions.k8s.io/v1/customresourcedefinitions"
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


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _error(status: int, reason: str, message: str) -> kmock.KubernetesError:
    return kmock.KubernetesError(status=status, reason=reason, message=message, details={})


def status_body(code: int, reason: str, message: str = "") -> dict:
    """A `Status` object as the API server returns it on errors."""
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure"} | {
        "code": code,
        "reason": reason,
        "message": message or reason,
    }


def _key(resource) -> str:
    return f"{resource.group}/{resource.version}/{resource.plural}"


def _spec_part(obj: dict) -> dict:
    return {k: v for k, v in obj.items() if k not in ("metadata", "status")}


@attrs.define(kw_only=True)
class ApiEmulator(kmock.KubernetesEmulator):
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

    # -- state changes (synchronous: nothing interleaves inside one) -----------------------

    def _record(self, res: str, etype: str, obj: dict) -> None:
        self.history.append((self.revision, res, etype, copy.deepcopy(obj)))
        for waiter in self._waiters:
            waiter.set()

    def _bump(self, obj: dict) -> None:
        self.revision += 1
        obj["metadata"]["resourceVersion"] = str(self.revision)

    def _has_status(self, res: str) -> bool:
        info = self._info(res)
        return info is not None and "status" in info.subresources

    def _info(self, res: str):
        for resource in self._get_resources():
            if _key(resource) == res:
                return self.resources[resource]
        return None

    def create(self, res: str, namespace: str | None, obj: dict) -> dict:
        """Store a new object (201 semantics); raises 409 if it exists."""
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if not meta.get("name"):
            raise _error(422, "Invalid", "metadata.name: Required value")
        if namespace:
            meta["namespace"] = namespace
        if (res, namespace, meta["name"]) in self.store:
            raise _error(409, "AlreadyExists", f"{res} {meta['name']!r} already exists")
        for field in ("resourceVersion", "deletionTimestamp"):
            meta.pop(field, None)
        meta.update(uid=str(uuid.uuid4()), generation=1, creationTimestamp=_now())
        if self._has_status(res) and res != CRDS:
            obj.pop("status", None)
        self._bump(obj)
        self.store[res, namespace, meta["name"]] = obj
        if res == CRDS:
            self._serve_crd(obj)
        self._record(res, "ADDED", obj)
        if self._orphaned(obj):  # the garbage collector takes objects whose owners are gone
            self.remove(res, namespace, meta["name"])
        return obj

    def _orphaned(self, obj: dict) -> bool:
        owners = {o.get("uid") for o in obj["metadata"].get("ownerReferences") or []}
        if not owners:
            return False
        return not any(o["metadata"].get("uid") in owners for o in self.store.values())

    def update(self, res: str, namespace: str | None, name: str, new: dict, status: bool) -> dict:
        """Replace an object's content; `status` selects the status subresource."""
        old = self.store.get((res, namespace, name))
        if old is None:
            raise _error(404, "NotFound", f"{res} {name!r} not found")
        want_rv = (new.get("metadata") or {}).get("resourceVersion")
        if want_rv and want_rv != old["metadata"]["resourceVersion"]:
            raise _error(409, "Conflict", "the object has been modified; please apply your changes")
        result = copy.deepcopy(old)
        if status:
            result["status"] = copy.deepcopy(new.get("status"))
        else:
            meta = dict(new.get("metadata") or {})
            for field in ("uid", "creationTimestamp", "generation", "resourceVersion", "name"):
                meta[field] = old["metadata"].get(field)
            if old["metadata"].get("deletionTimestamp"):
                meta["deletionTimestamp"] = old["metadata"]["deletionTimestamp"]
            keep_status = self._has_status(res) and res != CRDS
            result = {**_spec_part(new), "metadata": meta}
            if keep_status and "status" in old:
                result["status"] = old["status"]
            elif not keep_status and "status" in new:
                result["status"] = new["status"]
            result["metadata"] = {k: v for k, v in meta.items() if v is not None}
            if _spec_part(result) != _spec_part(old):
                result["metadata"]["generation"] = old["metadata"].get("generation", 1) + 1
        if result == old:
            return old  # a no-op write changes nothing, as on a real server
        meta = result["metadata"]
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            return self.remove(res, namespace, name)
        self._bump(result)
        self.store[res, namespace, name] = result
        if res == CRDS:
            self._serve_crd(result)
        self._record(res, "MODIFIED", result)
        return result

    def delete(self, res: str, namespace: str | None, name: str, orphan: bool = False) -> dict:
        """Delete now, or mark for deletion while finalizers remain."""
        obj = self.store.get((res, namespace, name))
        if obj is None:
            raise _error(404, "NotFound", f"{res} {name!r} not found")
        if obj["metadata"].get("finalizers"):
            if not obj["metadata"].get("deletionTimestamp"):
                marked = copy.deepcopy(obj)
                marked["metadata"]["deletionTimestamp"] = _now()
                self._bump(marked)
                self.store[res, namespace, name] = marked
                self._record(res, "MODIFIED", marked)
            return self.store[res, namespace, name]
        return self.remove(res, namespace, name, orphan)

    def remove(self, res: str, namespace: str | None, name: str, orphan: bool = False) -> dict:
        """Drop an object and (unless orphaned) garbage-collect what it owns."""
        obj = self.store.pop((res, namespace, name))
        self._bump(obj)
        self._record(res, "DELETED", obj)
        uid = obj["metadata"]["uid"]
        if not orphan:
            for key, child in list(self.store.items()):
                owners = child["metadata"].get("ownerReferences") or []
                if key in self.store and any(o.get("uid") == uid for o in owners):
                    self.delete(*key)
        return obj

    def _serve_crd(self, crd: dict) -> None:
        spec, names = crd["spec"], crd["spec"]["names"]
        for version in spec["versions"]:
            if version.get("served", True):
                self.resources[f"{spec['group']}/{version['name']}/{names['plural']}"] = (
                    kmock.ResourceInfo(
                        kind=names["kind"],
                        singular=names.get("singular"),
                        namespaced=spec.get("scope") == "Namespaced",
                        shortnames=set(names.get("shortNames") or ()),
                        categories=set(names.get("categories") or ()),
                        verbs={"create", "delete", "get", "list", "patch", "update", "watch"},
                        subresources=set(version.get("subresources") or ()),
                    )
                )
        crd["status"] = {
            "acceptedNames": names,
            "storedVersions": [v["name"] for v in spec["versions"] if v.get("storage")],
            "conditions": [
                {"type": t, "status": "True", "reason": t, "lastTransitionTime": _now()}
                for t in ("NamesAccepted", "Established")
            ],
        }

    def cut_watches(self) -> None:
        """End every open watch stream (clients must reconnect and resume)."""
        self._epoch += 1
        for waiter in self._waiters:
            waiter.set()

    def compact(self) -> None:
        """Forget history: watches resuming from an older resourceVersion get 410 Gone."""
        self.compacted = self.revision
        self.history.clear()
        self.cut_watches()

    def fail(self, method: str, resource: str, status: int, times: int = 1, subresource=None):
        """Answer the next `times` matching requests with an error, via kmock's DSL."""
        criteria = [kmock.method(method.upper()), kmock.resource(resource)]
        if subresource:
            criteria.append(kmock.subresource(subresource))
        reason = {409: "Conflict", 429: "TooManyRequests"}.get(status, "InternalError")
        left = [times]

        def respond():
            if left[0] <= 0:
                return NotImplemented  # spent: kmock disables this reaction, fallbacks serve
            left[0] -= 1
            return kmock.Response(status=status, payload=status_body(status, reason))

        return self[tuple(criteria)] << respond

    # -- HTTP handlers -------------------------------------------------------------------

    async def _serve_version(self, request):
        # kmock lists subresources with the parent's short names; kubectl then warns that
        # `ipool` is ambiguous. A real server gives subresources no short names.
        payload = await super()._serve_version(request)
        for entry in payload.get("resources", []):
            if "/" in entry["name"]:
                entry.update(shortNames=[], categories=[])
        return payload

    def _resolve(self, request) -> tuple[str, str | None]:
        res = _key(request.resource)
        info = self._info(res)
        if info is None:
            raise _error(404, "NotFound", f"the server could not find the resource {res}")
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
            raise _error(404, "NotFound", f"{res} {request.name!r} not found")
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
                raise _error(404, "NotFound", f"{res} {request.name!r} not found")
            elif ctype == "application/json-patch+json":
                new = json_patch(live, json.loads(request.text))
            else:  # merge-patch+json; strategic-merge-patch+json approximated as merge
                new = merge_patch(live, json.loads(request.text))
        except PatchError as exc:
            raise _error(422, "Invalid", str(exc)) from exc
        if new["metadata"].get("resourceVersion") == live["metadata"].get("resourceVersion"):
            new["metadata"].pop("resourceVersion", None)  # untouched: no precondition asked
        return copy.deepcopy(self.update(res, namespace, request.name, new, status))

    async def _serve_delete(self, request):
        res, namespace = self._resolve(request)
        body = request.data if isinstance(request.data, dict) else {}
        orphan = body.get("propagationPolicy") == "Orphan"
        return copy.deepcopy(self.delete(res, namespace, request.name, orphan))
