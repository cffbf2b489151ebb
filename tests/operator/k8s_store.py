"""Object semantics of the API emulator (a mixin of `k8s_emulator.ApiEmulator`): what a real
API server does on create / update / delete, synchronously, on plain dicts.

State: `store` {(resource key, namespace, name): object}, `history` [(resourceVersion,
resource key, event type, object)] for watches, `revision` (the last resourceVersion).
"""

from __future__ import annotations

import copy
import datetime
import uuid

import kmock

CRDS = "apiextensions.k8s.io/v1/customresourcedefinitions"


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def api_error(status: int, reason: str, message: str) -> kmock.KubernetesError:
    return kmock.KubernetesError(status=status, reason=reason, message=message, details={})


def status_body(code: int, reason: str, message: str = "") -> dict:
    """A `Status` object as the API server returns it on errors."""
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure"} | {
        "code": code,
        "reason": reason,
        "message": message or reason,
    }


def resource_key(resource) -> str:
    return f"{resource.group}/{resource.version}/{resource.plural}"


def _spec_part(obj: dict) -> dict:
    return {k: v for k, v in obj.items() if k not in ("metadata", "status")}


class ObjectStore:
    """create / update / delete / remove with server-side fields, generations, status
    subresources, finalizers and owner-reference garbage collection.

    Synchronous on purpose: the emulator's event loop runs one of these at a time, so no
    change interleaves with another. Needs `store`, `history`, `revision`, `compacted`,
    `_waiters`, `_epoch` and kmock's `resources` on the class it is mixed into.
    """

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
            if resource_key(resource) == res:
                return self.resources[resource]
        return None

    def create(self, res: str, namespace: str | None, obj: dict) -> dict:
        """Store a new object (201 semantics); raises 409 if it exists."""
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if not meta.get("name"):
            raise api_error(422, "Invalid", "metadata.name: Required value")
        if namespace:
            meta["namespace"] = namespace
        if (res, namespace, meta["name"]) in self.store:
            raise api_error(409, "AlreadyExists", f"{res} {meta['name']!r} already exists")
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
            raise api_error(404, "NotFound", f"{res} {name!r} not found")
        want_rv = (new.get("metadata") or {}).get("resourceVersion")
        if want_rv and want_rv != old["metadata"]["resourceVersion"]:
            raise api_error(
                409, "Conflict", "the object has been modified; please apply your changes"
            )
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
            raise api_error(404, "NotFound", f"{res} {name!r} not found")
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
