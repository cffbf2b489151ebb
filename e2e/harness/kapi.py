"""A thin dict-in, dict-out client for the harness's controllers (official `kubernetes`
ApiClient underneath, so requests look like any client's)."""

from __future__ import annotations

import json
from urllib.parse import urlencode

PATHS = {
    "Pod": ("/api/v1", "pods"),
    "Service": ("/api/v1", "services"),
    "Secret": ("/api/v1", "secrets"),
    "ConfigMap": ("/api/v1", "configmaps"),
    "ServiceAccount": ("/api/v1", "serviceaccounts"),
    "Namespace": ("/api/v1", "namespaces"),
    "Deployment": ("/apis/apps/v1", "deployments"),
    "EndpointSlice": ("/apis/discovery.k8s.io/v1", "endpointslices"),
    "Node": ("/api/v1", "nodes"),
    "Lease": ("/apis/coordination.k8s.io/v1", "leases"),
    "PersistentVolume": ("/api/v1", "persistentvolumes"),
    "PersistentVolumeClaim": ("/api/v1", "persistentvolumeclaims"),
}


class ApiError(Exception):
    """A failed request: HTTP status and the start of the server's answer."""

    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}")
        self.status = status


class Api:
    """get / list / create / patch / delete for the kinds in PATHS."""

    def __init__(self, kubeconfig: str):
        from kubernetes import config

        self.client = config.new_client_from_config(config_file=str(kubeconfig))

    def _path(self, kind: str, namespace: str | None, name: str | None = None, sub: str = ""):
        prefix, plural = PATHS[kind]
        path = prefix + (f"/namespaces/{namespace}" if namespace else "") + f"/{plural}"
        return path + (f"/{name}" if name else "") + (f"/{sub}" if sub else "")

    def _call(self, method: str, path: str, body=None, ctype="application/json", query=None):
        url = self.client.configuration.host + path
        if query:
            url += "?" + urlencode(query)
        headers = {"Content-Type": ctype, "Accept": "application/json"}
        resp = self.client.call_api(method, url, headers, body, None, 30)
        data = resp.read()
        if resp.status == 404 and method in ("GET", "DELETE"):
            return None
        if resp.status >= 300:
            raise ApiError(resp.status, f"{method} {path}: {data[:300]!r}")
        return json.loads(data) if data else None

    def get(self, kind: str, namespace: str | None, name: str) -> dict | None:
        return self._call("GET", self._path(kind, namespace, name))

    def list(
        self, kind: str, namespace: str | None = None, selector: str = "", fields: str = ""
    ) -> list[dict]:
        query = {"labelSelector": selector} if selector else {}
        if fields:
            query["fieldSelector"] = fields
        return (self._call("GET", self._path(kind, namespace), query=query) or {})["items"]

    def create(self, kind: str, namespace: str | None, obj: dict) -> dict:
        return self._call("POST", self._path(kind, namespace), obj)

    def patch(self, kind: str, namespace: str, name: str, patch: dict, sub: str = "") -> dict:
        path = self._path(kind, namespace, name, sub)
        return self._call("PATCH", path, patch, "application/merge-patch+json")

    def token(self, namespace: str, account: str, pod: dict, seconds: int, audience=None) -> str:
        """A ServiceAccount token bound to `pod` (the TokenRequest API, as a kubelet asks)."""
        spec = {
            "expirationSeconds": seconds,
            "boundObjectRef": {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": pod["metadata"]["name"],
                "uid": pod["metadata"]["uid"],
            },
        }
        if audience:
            spec["audiences"] = [audience]
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec}
        path = self._path("ServiceAccount", namespace, account, "token")
        return self._call("POST", path, body)["status"]["token"]

    def delete(self, kind: str, namespace: str, name: str, grace: int | None = None) -> None:
        query = None if grace is None else {"gracePeriodSeconds": grace}
        self._call("DELETE", self._path(kind, namespace, name), query=query)

    def close(self) -> None:
        self.client.close()
