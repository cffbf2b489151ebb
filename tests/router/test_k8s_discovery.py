"""KubernetesDiscovery against kmock's Kubernetes API emulator (a real HTTP API server
process-local thread; the kubernetes client talks to it as to a cluster)."""

from __future__ import annotations

import asyncio
import http.server
import json
import socket
import threading
import time

import httpx
import pytest

from epdserve.router.discovery import KubernetesDiscovery, parse_selector, selector_matches
from epdserve.router.service import Router
from epdserve.router.strategy import make_strategy

kmock = pytest.importorskip("kmock")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Emulator:
    """kmock's emulator served from its own thread and event loop."""

    def __init__(self) -> None:
        self.port = free_port()
        self._ready, self._stop = threading.Event(), None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self._thread.start()
        assert self._ready.wait(15), "kmock did not start"

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        async with (
            kmock.KubernetesEmulator() as k,
            kmock.Server(k, host="127.0.0.1", port=self.port),
        ):
            k.resources.load_bundled()
            self._ready.set()
            await self._stop.wait()

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def pod(name: str, ip: str, ready: bool = True, app: str = "engine") -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "ns", "labels": {"app": app}},
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


@pytest.fixture
def emulator():
    e = Emulator()
    yield e
    e.close()


def kubeconfig(tmp_path, url: str) -> str:
    path = tmp_path / "kubeconfig"
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        f"clusters: [{{name: k, cluster: {{server: '{url}'}}}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: c, context: {cluster: k, user: u, namespace: ns}}]\n"
    )
    return str(path)


def names(router: Router) -> set[str]:
    return {p.name for p in router.pods()}


def wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met"
        time.sleep(0.05)


def test_ready_pods_matching_the_selector_come_and_go(emulator, tmp_path):
    api = emulator.url + "/api/v1/namespaces/ns/pods"
    httpx.post(api, json=pod("e0", "10.0.0.1"), timeout=5).raise_for_status()
    httpx.post(api, json=pod("other", "10.0.0.9", app="redis"), timeout=5).raise_for_status()
    router = Router(make_strategy("round-robin"), None, subscribe=False)
    discovery = KubernetesDiscovery(
        "ns", "app=engine", 8000, 5557, 5558, kubeconfig=kubeconfig(tmp_path, emulator.url)
    )
    discovery.start(router)
    try:
        wait_for(lambda: names(router) == {"10.0.0.1:8000"})
        httpx.post(api, json=pod("e1", "10.0.0.2", ready=False), timeout=5).raise_for_status()
        httpx.post(api, json=pod("e2", "10.0.0.3"), timeout=5).raise_for_status()
        wait_for(lambda: names(router) == {"10.0.0.1:8000", "10.0.0.3:8000"})
        assert router.pod("10.0.0.3:8000").endpoint.events == "tcp://10.0.0.3:5557"
        httpx.delete(api + "/e0", timeout=5).raise_for_status()
        wait_for(lambda: names(router) == {"10.0.0.3:8000"})
    finally:
        discovery.stop()
        router.close()


class StalledWatchApi:
    """A stand-in API server whose LIST answers but whose WATCH sends its headers and then
    nothing, as a stream silently dropped by a proxy or load balancer looks to a client."""

    def __init__(self) -> None:
        self.pods: list[dict] = []
        self.watches = 0
        api = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                if "watch=true" in self.path.lower():
                    api.watches += 1
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.end_headers()
                    time.sleep(30)  # never an event, never an end
                    return
                body = json.dumps(
                    {
                        "kind": "PodList",
                        "apiVersion": "v1",
                        "metadata": {"resourceVersion": "1"},
                        "items": list(api.pods),
                    }
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_watch_that_goes_silent_is_dropped_and_the_relist_catches_up(tmp_path):
    api = StalledWatchApi()
    api.pods.append(pod("e0", "10.0.0.1"))
    router = Router(make_strategy("round-robin"), None, subscribe=False)
    discovery = KubernetesDiscovery(
        "ns",
        "app=engine",
        8000,
        5557,
        5558,
        kubeconfig=kubeconfig(tmp_path, api.url),
        relist_s=1,
        resync_backoff=0.1,
    )
    discovery.start(router)
    try:
        wait_for(lambda: names(router) == {"10.0.0.1:8000"})
        wait_for(lambda: api.watches >= 1)
        api.pods[:] = [pod("e1", "10.0.0.2")]  # a change the silent watch never tells
        wait_for(lambda: names(router) == {"10.0.0.2:8000"})
        assert discovery.missed >= 1
    finally:
        discovery.stop()
        router.close()
        api.close()


def test_selector_terms_match_like_kubernetes():
    terms = parse_selector("app=engine, tier!=gpu,role")
    assert selector_matches(terms, {"app": "engine", "role": "decode"})
    assert not selector_matches(terms, {"app": "engine", "role": "x", "tier": "gpu"})
    assert not selector_matches(terms, {"app": "engine"})
