"""The operator tests' API emulator with what kubectl's watches need on top.

kubectl (client-go) refuses a watch stream without a JSON content type ("no stream
serializers registered for application/octet-stream"); kmock streams default to
octet-stream, so watch answers here say `application/json`. And kubectl 1.37 lists through
a watch (`sendInitialEvents=true`, the WatchList feature): the current objects as ADDED, then
a BOOKMARK annotated `k8s.io/initial-events-end`, then changes; served here as such.

Pods bound to a node are deleted gracefully, as by a real API server: a DELETE marks them
(`deletionTimestamp`, `deletionGracePeriodSeconds`) and the kubelet removes them once their
containers have run their preStop hooks and stopped (kubelet.py); `gracePeriodSeconds=0`
removes at once. Owner garbage collection goes through the same path.
"""

from __future__ import annotations

import asyncio
import copy
import time

import kmock
from k8s_emulator import ApiEmulator
from k8s_server import EmulatorThread


class WatchableEmulator(ApiEmulator):
    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        # No metrics-server here: kmock's bundled metrics.k8s.io `pods` would otherwise win
        # kubectl's name resolution (`kubectl delete pods X` -> PodMetrics, 404).
        for resource in list(self._get_resources()):
            if resource.group == "metrics.k8s.io":
                del self.resources[resource]

    async def _serve_version(self, request):
        # kmock names the core group's version "/v1"; kubectl then maps no core resource
        # at all ("the server doesn't have a resource type services").
        payload = await super()._serve_version(request)
        if isinstance(payload, dict) and payload.get("groupVersion") == "/v1":
            payload["groupVersion"] = "v1"
        return payload

    def delete(self, res, namespace, name, orphan=False, grace=None):
        obj = self.store.get((res, namespace, name))
        running = obj is not None and res == "/v1/pods" and (obj.get("spec") or {}).get("nodeName")
        if not running or obj["metadata"].get("finalizers"):
            return super().delete(res, namespace, name, orphan)
        if grace is None:
            grace = int(obj["spec"].get("terminationGracePeriodSeconds", 30))
        if grace <= 0:
            return self.remove(res, namespace, name, orphan)
        if obj["metadata"].get("deletionTimestamp"):
            return obj  # already terminating: a second DELETE changes nothing
        marked = copy.deepcopy(obj)
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + grace))
        marked["metadata"].update(deletionTimestamp=when, deletionGracePeriodSeconds=grace)
        self._bump(marked)
        self.store[res, namespace, name] = marked
        self._record(res, "MODIFIED", marked)
        return marked

    async def _serve_delete(self, request):
        res, namespace = self._resolve(request)
        body = request.data if isinstance(request.data, dict) else {}
        orphan = body.get("propagationPolicy") == "Orphan"
        grace = request.params.get("gracePeriodSeconds", body.get("gracePeriodSeconds"))
        grace = None if grace is None else int(grace)
        return copy.deepcopy(self.delete(res, namespace, request.name, orphan, grace))

    def _serve_watch(self, request):
        if request.params.get("sendInitialEvents") == "true":
            stream = self._watch_list(request)
        else:
            stream = ApiEmulator._serve_watch(self, request)
        return kmock.Response(headers={"Content-Type": "application/json"}, payload=stream)

    async def _watch_list(self, request):
        res, namespace = self._resolve(request)
        yield b""
        revision, position = self.revision, len(self.history)
        for key, obj in list(self.store.items()):
            if self._matches(request, res, namespace, key, obj):
                yield {"type": "ADDED", "object": copy.deepcopy(obj)}
        group, version, _ = res.split("/")
        marker = {
            "kind": self._info(res).kind,
            "apiVersion": f"{group}/{version}" if group else version,
            "metadata": {
                "resourceVersion": str(revision),
                "annotations": {"k8s.io/initial-events-end": "true"},
            },
        }
        yield {"type": "BOOKMARK", "object": marker}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + float(request.params.get("timeoutSeconds") or 3600)
        epoch, waiter = self._epoch, asyncio.Event()
        self._waiters.add(waiter)
        try:
            while epoch == self._epoch and loop.time() < deadline:
                while position < len(self.history):
                    _, key, etype, obj = self.history[position]
                    position += 1
                    where = (key, obj["metadata"].get("namespace"), obj["metadata"]["name"])
                    if self._matches(request, res, namespace, where, obj):
                        yield {"type": etype, "object": obj}
                waiter.clear()
                try:
                    await asyncio.wait_for(waiter.wait(), max(0.0, deadline - loop.time()))
                except TimeoutError:
                    return
        finally:
            self._waiters.discard(waiter)


class ApiServer(EmulatorThread):
    """EmulatorThread serving a WatchableEmulator."""

    def __init__(self, workdir, port: int | None = None):
        super().__init__(workdir, port)
        self.emulator = WatchableEmulator()
