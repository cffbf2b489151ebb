"""Pods the router can send to: their addresses and live load/health state."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from epdserve.router.lora import PodAdapters


@dataclass(frozen=True)
class PodEndpoint:
    """Where one engine pod answers HTTP and publishes KV events."""

    name: str
    url: str  # http://host:port
    events: str  # tcp://host:kv-events-port
    replay: str | None  # tcp://host:kv-replay-port

    @classmethod
    def parse(cls, spec: str, events_port: int, replay_port: int | None) -> PodEndpoint:
        """``--endpoint``: ``http://HOST:PORT`` with events on ``HOST:events_port``, or
        with per-pod overrides ``http://HOST:PORT,events=PORT|URL,replay=PORT|URL|none``
        (several pods on one machine cannot share one events port)."""
        url, *options = [part.strip() for part in spec.split(",")]
        endpoint = cls.from_url(url, events_port, replay_port)
        host = endpoint.events.rsplit(":", 1)[0]
        overrides: dict[str, str | None] = {}
        for option in options:
            key, sep, value = option.partition("=")
            if not sep or key not in ("events", "replay"):
                raise ValueError(
                    f"--endpoint option must be events=... or replay=..., got {option!r}"
                )
            if value == "none":
                overrides[key] = None
            else:
                overrides[key] = f"{host}:{int(value)}" if value.isdigit() else value
        if not overrides:
            return endpoint
        return cls(
            endpoint.name,
            endpoint.url,
            overrides.get("events", endpoint.events) or endpoint.events,
            overrides.get("replay", endpoint.replay),
        )

    @classmethod
    def from_url(cls, url: str, events_port: int, replay_port: int | None) -> PodEndpoint:
        """The repo-wide convention: events and replay on the pod's host, fixed ports."""
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme not in ("http", "https") or not parts.hostname or not parts.port:
            raise ValueError(f"--endpoint must look like http://HOST:PORT, got {url!r}")
        host = parts.hostname
        wrapped = f"[{host}]" if ":" in host else host
        replay = f"tcp://{wrapped}:{replay_port}" if replay_port else None
        return cls(
            name=f"{wrapped}:{parts.port}",
            url=f"{parts.scheme}://{wrapped}:{parts.port}",
            events=f"tcp://{wrapped}:{events_port}",
            replay=replay,
        )


@dataclass
class PodState:
    """Router-side view of one pod: in-flight requests, scraped load, health."""

    endpoint: PodEndpoint
    inflight: int = 0
    prefilling: int = 0  # of inflight: no first byte back yet
    prefill_tokens: float = 0.0  # their prompt tokens the pod must compute (router's estimate)
    running: float = 0.0  # vllm:num_requests_running
    waiting: float = 0.0  # vllm:num_requests_waiting
    kv_usage: float = 0.0  # vllm:kv_cache_usage_perc (0..1)
    healthy: bool = True
    down_until: float = 0.0
    consecutive_failures: int = 0
    scrape_timeouts: int = 0  # /metrics scrapes in a row that timed out (a busy pod)
    scraped_at: float = field(default=0.0)
    adapters: PodAdapters = field(default_factory=PodAdapters)  # LoRA adapters it holds

    @property
    def name(self) -> str:
        return self.endpoint.name

    def load(self) -> float:
        """Queue depth: the larger of our in-flight count and the pod's own numbers."""
        return max(float(self.inflight), self.running + self.waiting)

    def available(self, now: float | None = None) -> bool:
        """Healthy and not in a failure back-off."""
        return self.healthy and (now or time.monotonic()) >= self.down_until

    def mark_failed(self, backoff: float) -> None:
        """A request to the pod failed: keep it out of rotation for ``backoff`` seconds."""
        self.consecutive_failures += 1
        self.down_until = time.monotonic() + backoff * min(8, self.consecutive_failures)

    def mark_busy(self, seconds: float) -> None:
        """The pod said it is busy (503 + Retry-After): others first for ``seconds``; not a
        failure, so its failure backoff does not grow."""
        self.down_until = max(self.down_until, time.monotonic() + seconds)

    def mark_ok(self) -> None:
        """The pod answered: back in rotation."""
        self.consecutive_failures = 0
        self.down_until = 0.0
        self.healthy = True
