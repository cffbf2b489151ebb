"""`spec.router.tenancy`: tenant keys from a Secret and the router's fair queue.

The Secret's key (a JSON or YAML tenants file, see router/tenants.py) is mounted read-only
into the router pod and passed as `--tenant-keys`; the other fields become the router's
tenant flags. Errors name the field (`spec.router.tenancy.maxInflightPerPod`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from epdserve.operator.errors import InvalidSpec
from epdserve.operator.spec_fields import secret_ref

WHERE = "spec.router.tenancy"
MOUNT_DIR = "/etc/epdserve/tenants"
FILE = "tenants.yaml"
VOLUME = "tenant-keys"
HEADER = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]{1,64}$")


@dataclass(frozen=True)
class TenancySpec:
    """What the router needs to know about tenants (defaults: the router's own)."""

    keys_secret: tuple[str, str] | None = None  # (secret name, key) of the tenants file
    header: str | None = None  # a trusted gateway's tenant header
    max_inflight_per_pod: int = 0  # 0: no fair queue
    reserve_per_pod: int = 0
    queue_size: int = 256
    queue_timeout_seconds: float = 30.0
    priority: bool = False


def parse_tenancy(raw: dict | None) -> TenancySpec | None:
    """The validated `spec.router.tenancy`, or None when absent."""
    if not raw:
        return None
    spec = TenancySpec(
        keys_secret=secret_ref(raw.get("keysSecretRef"), FILE, f"{WHERE}.keysSecretRef"),
        header=raw.get("header") or None,
        max_inflight_per_pod=_int(raw, "maxInflightPerPod", 0, 0),
        reserve_per_pod=_int(raw, "reservePerPod", 0, 0),
        queue_size=_int(raw, "queueSize", 256, 1),
        queue_timeout_seconds=_seconds(raw.get("queueTimeoutSeconds", 30.0)),
        priority=bool(raw.get("priority", False)),
    )
    if spec.header is not None and (
        not HEADER.match(spec.header) or spec.header.lower() == "authorization"
    ):
        raise InvalidSpec(f"{WHERE}.header: not a usable header name: {spec.header!r}")
    return spec


def _int(raw: dict, field: str, default: int, low: int) -> int:
    value = raw.get(field, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InvalidSpec(f"{WHERE}.{field}: must be an integer >= {low}, got {value!r}")
    return value


def _seconds(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise InvalidSpec(f"{WHERE}.queueTimeoutSeconds: must be a number > 0, got {value!r}")
    return float(value)


def router_args(spec: TenancySpec | None) -> list[str]:
    """The router's tenant flags (none when `tenancy` is absent)."""
    if spec is None:
        return []
    args = []
    if spec.keys_secret is not None:
        args += ["--tenant-keys", f"{MOUNT_DIR}/{FILE}"]
    if spec.header:
        args += ["--tenant-header", spec.header]
    if spec.max_inflight_per_pod:
        args += ["--max-inflight-per-pod", str(spec.max_inflight_per_pod)]
        args += ["--tenant-reserve-per-pod", str(spec.reserve_per_pod)]
        args += ["--tenant-queue-size", str(spec.queue_size)]
        args += ["--tenant-queue-timeout", f"{spec.queue_timeout_seconds:g}"]
    if spec.priority:
        args.append("--tenant-priority")
    return args


def engine_args(spec: TenancySpec | None, role_args: list[str]) -> list[str]:
    """Tenant priorities need the engines' priority policy (fcfs refuses a non-zero one),
    unless the role's own args choose a policy."""
    if spec is None or not spec.priority or "--scheduling-policy" in role_args:
        return []
    return ["--scheduling-policy", "priority"]


def router_volumes(spec: TenancySpec | None) -> tuple[list[dict], list[dict]]:
    """(volumes, mounts) of the tenants Secret: its one key as `tenants.yaml`, read-only."""
    if spec is None or spec.keys_secret is None:
        return [], []
    secret, key = spec.keys_secret
    volume = {
        "name": VOLUME,
        "secret": {
            "secretName": secret,
            "items": [{"key": key, "path": FILE}],
            "defaultMode": 0o440,
        },
    }
    return [volume], [{"name": VOLUME, "mountPath": MOUNT_DIR, "readOnly": True}]
