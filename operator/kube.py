"""A small generic Kubernetes REST client over the official `kubernetes` ApiClient.

The operator speaks plain dicts (what the builders produce), so it needs get/create/apply/
delete/list for any kind, not the typed models. Errors become :class:`ApiError`.
"""

from __future__ import annotations

import json
import os
from urllib.parse import quote

# kind -> plural for every kind the operator touches
PLURALS = {
    "ConfigMap": "configmaps",
    "Secret": "secrets",
    "Service": "services",
    "ServiceAccount": "serviceaccounts",
    "Event": "events",
    "Pod": "pods",
    "EndpointSlice": "endpointslices",
    "Deployment": "deployments",
    "Role": "roles",
    "RoleBinding": "rolebindings",
    "NetworkPolicy": "networkpolicies",
    "ServiceMonitor": "servicemonitors",
    "HorizontalPodAutoscaler": "horizontalpodautoscalers",
    "ScaledObject": "scaledobjects",
    "InferencePool": "inferencepools",
}
FIELD_MANAGER = "epdserve-operator"
TRANSIENT = {408, 409, 425, 429, 500, 502, 503, 504}


class ApiError(Exception):
    """A failed API call: HTTP status (0 when no response came) and the server's message."""

    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message

    @property
    def transient(self) -> bool:
        """Worth retrying unchanged: conflicts, throttling, server errors, no answer."""
        return self.status == 0 or self.status in TRANSIENT


def load_configuration():
    """In-cluster config when running in a pod, else $KUBECONFIG (read now, not at import)."""
    from kubernetes import client, config

    cfg = client.Configuration()
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(client_configuration=cfg)
    else:
        config.load_kube_config(
            config_file=os.environ.get("KUBECONFIG") or None, client_configuration=cfg
        )
    return cfg


def object_path(api_version: str, kind: str, namespace: str | None, name: str = "") -> str:
    """REST path of a namespaced collection (name empty) or object."""
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{prefix}/namespaces/{quote(namespace)}/{PLURALS[kind]}" if namespace else prefix
    return f"{path}/{quote(name)}" if name else path


class Kube:
    """Generic dict-in, dict-out API calls (synchronous; kopf runs sync handlers in threads)."""

    def __init__(self, configuration=None, timeout: float = 30.0):
        from kubernetes import client

        self.api = client.ApiClient(configuration or load_configuration())
        self.timeout = timeout

    def close(self) -> None:
        self.api.close()

    def request(
        self, method: str, path: str, body=None, query=None, content_type="application/json"
    ) -> dict:
        """One API call; returns the decoded JSON body or raises ApiError."""
        from kubernetes.client.exceptions import ApiException

        # JSON content types are encoded by the client; YAML ones (apply) must arrive as text.
        data = json.dumps(body) if body is not None and "yaml" in content_type else body
        serialized = self.api.param_serialize(
            method=method,
            resource_path=path,
            query_params=list((query or {}).items()),
            header_params={"Content-Type": content_type, "Accept": "application/json"},
            body=data,
            auth_settings=["BearerToken"],
        )
        try:
            response = self.api.call_api(*serialized, _request_timeout=self.timeout)
            raw = response.read()
        except ApiException as exc:
            raise ApiError(exc.status or 0, str(exc.reason)) from exc
        except Exception as exc:  # connection refused/reset, timeouts: no answer at all
            raise ApiError(0, f"{type(exc).__name__}: {exc}") from exc
        if not 200 <= response.status < 300:
            raise ApiError(response.status, _message(raw))
        return json.loads(raw) if raw else {}

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
        """The object, or None if it does not exist."""
        try:
            return self.request("GET", object_path(api_version, kind, namespace, name))
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    def list(self, api_version: str, kind: str, namespace: str, selector: str) -> list[dict]:
        """Objects of a kind in a namespace matching a label selector."""
        path = object_path(api_version, kind, namespace)
        return self.request("GET", path, query={"labelSelector": selector}).get("items") or []

    def create(self, obj: dict) -> dict:
        """POST the object (409 if it exists)."""
        meta = obj["metadata"]
        path = object_path(obj["apiVersion"], obj["kind"], meta["namespace"])
        return self.request("POST", path, body=obj)

    def apply(self, obj: dict) -> dict:
        """Server-side apply with force: the operator owns every field it sets."""
        meta = obj["metadata"]
        path = object_path(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
        query = {"fieldManager": FIELD_MANAGER, "force": "true"}
        return self.request(
            "PATCH", path, body=obj, query=query, content_type="application/apply-patch+yaml"
        )

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        """Delete (background propagation); a missing object is not an error."""
        path = object_path(api_version, kind, namespace, name)
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
        try:
            self.request("DELETE", path, body=body)
        except ApiError as exc:
            if exc.status != 404:
                raise


def _message(raw: bytes) -> str:
    try:
        return str(json.loads(raw).get("message") or raw[:200])
    except (ValueError, AttributeError):
        return raw[:200].decode(errors="replace")
