"""``--kv-events-config``: the same JSON keys (and defaults) as vLLM's flag, plus replay
limits of our own; and where a wildcard endpoint binds (the pod IP when known)."""

from __future__ import annotations

import ipaddress
import json
import os
from dataclasses import dataclass, fields

PUBLISHERS = ("null", "zmq")
POD_IP_ENV = "EPDSERVE_POD_IP"  # the operator sets it from the downward API (status.podIP)


@dataclass(frozen=True)
class KVEventsConfig:
    """Where and how an engine pod publishes its KV-cache events."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    # ours: a replay answers at most this many batches (then the end marker; ask again from
    # the next seq), and serves at most this many peers at once (others are refused)
    replay_max_batches: int = 1_000
    replay_max_in_flight: int = 64

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError("kv-events-config: enable_kv_cache_events must be a boolean")
        if self.publisher not in PUBLISHERS:
            raise ValueError(f"kv-events-config: publisher must be one of {PUBLISHERS}")
        for name in (
            "buffer_steps",
            "hwm",
            "max_queue_size",
            "replay_max_batches",
            "replay_max_in_flight",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"kv-events-config: {name} must be a positive integer")
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"kv-events-config: {name} must be a string")
        if self.replay_endpoint is not None and not isinstance(self.replay_endpoint, str):
            raise ValueError("kv-events-config: replay_endpoint must be a string or null")

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parse the flag's JSON; unknown keys are an error naming the key."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"kv-events-config: invalid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ValueError("kv-events-config: expected a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"kv-events-config: unknown key(s) {unknown}; known: {sorted(known)}")
        # vLLM picks the zmq publisher when events are enabled without naming one
        if data.get("enable_kv_cache_events") and "publisher" not in data:
            data["publisher"] = "zmq"
        return cls(**data)

    @property
    def active(self) -> bool:
        """True when events should actually be published."""
        return self.enable_kv_cache_events and self.publisher != "null"


def binds(endpoint: str) -> bool:
    """vLLM's rule: wildcard, ipc and inproc endpoints bind; others connect."""
    return "*" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def pod_ip_from_env() -> str | None:
    """The pod IP the operator passes in ``EPDSERVE_POD_IP`` (None when unset or empty)."""
    value = os.environ.get(POD_IP_ENV, "").strip()
    if not value:
        return None
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        raise ValueError(f"{POD_IP_ENV}: not an IP address: {value!r}") from None


def bind_address(endpoint: str, pod_ip: str | None) -> str:
    """The address a binding endpoint binds: a ``tcp://*:PORT`` wildcard becomes the pod IP
    when one is known (so events are not offered on every interface); any other endpoint
    (an explicit host, ipc, inproc) is used as configured."""
    if pod_ip is None or not endpoint.startswith("tcp://*:"):
        return endpoint
    host = f"[{pod_ip}]" if ":" in pod_ip else pod_ip  # IPv6 in brackets
    return f"tcp://{host}:{endpoint[len('tcp://*:') :]}"
