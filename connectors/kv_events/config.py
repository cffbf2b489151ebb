"""``--kv-events-config``: the same JSON keys (and defaults) as vLLM's flag, plus replay
limits of our own; and where a wildcard endpoint binds (the pod IP when known)."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass

from epdserve.common.cli_fields import config_from, json_object

PUBLISHERS = ("null", "zmq")
POSITIVE = ("buffer_steps", "hwm", "max_queue_size", "replay_max_batches", "replay_max_in_flight")
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
        name = "kv_events_config"
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError(f"{name}.enable_kv_cache_events: must be a boolean")
        if self.publisher not in PUBLISHERS:
            raise ValueError(
                f"{name}.publisher: must be one of {', '.join(PUBLISHERS)}, got {self.publisher!r}"
            )
        for key in POSITIVE:
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}.{key}: must be a positive integer, got {value!r}")
        for key in ("endpoint", "topic"):
            if not isinstance(getattr(self, key), str):
                raise ValueError(f"{name}.{key}: must be a string")
        if self.replay_endpoint is not None and not isinstance(self.replay_endpoint, str):
            raise ValueError(f"{name}.replay_endpoint: must be a string or null")

    @classmethod
    def parse(cls, value: str | dict | KVEventsConfig | None) -> KVEventsConfig | None:
        """From the flag's JSON text (or a dict); unknown keys are an error naming the key."""
        if isinstance(value, str):
            value = json_object(value, "kv_events_config")
        # vLLM picks the zmq publisher when events are enabled without naming one
        if isinstance(value, dict) and value.get("enable_kv_cache_events"):
            value = {"publisher": "zmq", **value}
        return config_from(cls, value, "kv_events_config")

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
