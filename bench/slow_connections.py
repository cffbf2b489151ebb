"""Slow clients against a running server (an engine pod or the router): do normal clients
still get served while ``--slow`` connections dribble their headers or bodies?

Two phases of ``--seconds`` each, side by side in one run: ``baseline`` (normal clients
only) and ``slow`` (the same normal clients while ``--slow`` connections are held open).
Half the slow connections send a request's headers one byte every ``--byte-interval``
seconds; the other half send full headers announcing a body, then the body one byte at a
time. Whenever the server closes one, it is opened again at once, so ``--slow`` are held
throughout. Normal clients are ``--clients`` loops each POSTing a short completion
back to back. Prints one JSON object: per phase, the normal clients' requests, success
rate and latency percentiles, and what happened to the slow connections.

    .venv/bin/python bench/slow_connections.py --url http://127.0.0.1:8000 \\
        [--api-key KEY] [--slow 1000] [--seconds 30] [--clients 4] [--model tiny]

Every slow connection is a file descriptor here too: the soft open-file limit is raised
to the hard one (``ulimit -Hn``); a hard limit below ``--slow`` + 100 is refused.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import time
from collections import Counter
from urllib.parse import urlsplit

import httpx


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def raise_fd_limit(needed: int) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise SystemExit(f"open-file hard limit {hard} < {needed}: raise `ulimit -Hn`")
    if soft != resource.RLIM_INFINITY and soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


class SlowConnections:
    """``count`` connections kept open and dribbling bytes until ``stop``."""

    def __init__(self, host: str, port: int, count: int, interval: float, api_key: str | None):
        self.host, self.port, self.count, self.interval = host, port, count, interval
        auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
        head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n{auth}"
        self.slow_headers = (head + "X-Pad: ").encode() + b"a" * 100000  # never ends
        self.slow_body = (head + "Content-Type: application/json\r\n").encode()
        self.slow_body += b"Content-Length: 100000\r\n\r\n"
        self.stats: Counter = Counter()
        self.open = 0
        self.stop = asyncio.Event()

    async def run(self) -> None:
        await asyncio.gather(*(self._hold(i) for i in range(self.count)))

    async def _hold(self, i: int) -> None:
        await asyncio.sleep(i * 0.002)  # ramp up over ~2 s per 1,000
        while not self.stop.is_set():
            await self._one(slow_body=i % 2 == 1)

    async def _one(self, slow_body: bool) -> None:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(self.host, self.port), 10
            )
        except (OSError, TimeoutError) as exc:
            self.stats[f"connect_error:{type(exc).__name__}"] += 1
            await asyncio.sleep(0.5)
            return
        self.stats["opened"] += 1
        self.open += 1
        try:
            if slow_body:
                writer.write(self.slow_body)  # headers at once, then the body crawls
            data = b"{" * 100000 if slow_body else self.slow_headers
            for byte in data:
                if self.stop.is_set():
                    return
                writer.write(bytes([byte]))
                await writer.drain()
                try:  # a reply (408, 503, ...) or a close ends this connection
                    answer = await asyncio.wait_for(reader.read(64), self.interval)
                except TimeoutError:
                    continue
                status = answer[9:12].decode(errors="replace") if answer else "closed"
                self.stats[f"ended:{status}"] += 1
                return
            self.stats["finished_request"] += 1
        except OSError as exc:
            self.stats[f"ended:{type(exc).__name__}"] += 1
        finally:
            self.open -= 1
            writer.close()


async def normal_clients(url: str, body: dict, headers: dict, clients: int, seconds: float):
    """``clients`` loops sending ``body`` back to back: ``(latencies of 200s, statuses)``."""
    latencies: list[float] = []
    statuses: Counter = Counter()
    deadline = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(timeout=30, limits=limits, headers=headers) as client:

        async def loop():
            while time.monotonic() < deadline:
                start = time.monotonic()
                try:
                    r = await client.post(url + "/v1/completions", json=body)
                    status = str(r.status_code)
                except httpx.HTTPError as exc:
                    status = type(exc).__name__
                statuses[status] += 1
                if status == "200":
                    latencies.append(time.monotonic() - start)

        await asyncio.gather(*(loop() for _ in range(clients)))
    return latencies, statuses


def summary(latencies: list[float], statuses: Counter) -> dict:
    total = sum(statuses.values())
    ms = [x * 1000 for x in latencies]
    return {
        "requests": total,
        "success_rate": round(statuses.get("200", 0) / total, 4) if total else None,
        "statuses": dict(statuses),
        "latency_ms": {
            "p50": percentile(ms, 0.5),
            "p90": percentile(ms, 0.9),
            "p99": percentile(ms, 0.99),
            "max": max(ms) if ms else None,
        },
    }


async def main_async(args) -> dict:
    parts = urlsplit(args.url)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    body = {"model": args.model, "prompt": "def f(x):", "max_tokens": 4, "temperature": 0}
    lat, st = await normal_clients(args.url, body, headers, args.clients, args.seconds)
    result = {"baseline": summary(lat, st)}
    slow = SlowConnections(parts.hostname, parts.port, args.slow, args.byte_interval, args.api_key)
    holder = asyncio.create_task(slow.run())
    await asyncio.sleep(args.slow * 0.002 + 1)  # all slow connections are open
    opened_at_start = slow.open
    lat, st = await normal_clients(args.url, body, headers, args.clients, args.seconds)
    held_at_end = slow.open
    slow.stop.set()
    await holder
    result["slow"] = summary(lat, st)
    result["slow"]["slow_connections"] = {
        "target": args.slow,
        "open_when_measuring": opened_at_start,
        "open_at_end": held_at_end,
        **dict(slow.stats),
    }
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True, help="http://HOST:PORT of a pod or router")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--model", default="tiny", help="served model name")
    ap.add_argument("--slow", type=int, default=1000, help="slow connections held")
    ap.add_argument("--seconds", type=float, default=30.0, help="length of each phase")
    ap.add_argument("--clients", type=int, default=4, help="concurrent normal clients")
    ap.add_argument("--byte-interval", type=float, default=1.0, help="s between slow bytes")
    args = ap.parse_args()
    fd_limit = raise_fd_limit(args.slow + 100)
    started = time.time()
    result = asyncio.run(main_async(args))
    result.update(
        url=args.url,
        started=started,
        seconds_per_phase=args.seconds,
        clients=args.clients,
        byte_interval_s=args.byte_interval,
        fd_limit=fd_limit,
    )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
