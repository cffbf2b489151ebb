"""A STAND-IN LoRA engine pod for the router's adapter tests: a real HTTP server (stdlib, in a
thread) with the pod side of the LoRA contract in its exact shapes: ``GET /v1/models`` (the
base model first, then the adapters with ``parent``), ``vllm:lora_requests_info`` on
``/metrics`` (an older label set kept beside the newest, as vLLM's gauge keeps them), and
``POST /v1/load_lora_adapter``. Generation routes answer which pod and adapter served them;
an unknown model gets the pods' 404.

(Imported by path from the tests, which run with ``--import-mode=importlib``.)"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

BASE = "tiny"


class LoraPod:
    """``adapters``: loaded names; ``running``: the gauge's running adapters and the load
    gauges' running count; ``load_gate``: loads wait for it; ``load_error``: (status,
    message) to refuse loads with."""

    def __init__(self, name: str, adapters=(), max_lora: int = 2, running: int = 0) -> None:
        self.name, self.max_lora, self.running = name, max_lora, running
        self.adapters: list[str] = list(adapters)
        self.running_adapters: list[str] = []
        self.load_gate = threading.Event()
        self.load_gate.set()
        self.load_error: tuple[int, str] | None = None
        self.loads: list[dict] = []  # bodies of load requests, in arrival order
        self.bodies: list[tuple[str, dict]] = []  # generation requests
        self.list_calls = 0
        self._lock = threading.Lock()
        pod = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                if self.path == "/metrics":
                    self._send(200, pod.metrics_page().encode(), "text/plain")
                elif self.path == "/v1/models":
                    with pod._lock:
                        pod.list_calls += 1
                    self._json(200, pod.model_list())
                else:
                    self._send(200, b"", "text/plain")

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/v1/load_lora_adapter":
                    status, answer = pod.load(body)
                    if status == 200:
                        self._send(200, answer.encode(), "text/plain")
                    else:
                        self._json(status, error(status, answer))
                else:
                    pod.bodies.append((self.path, body))
                    self._json(*pod.generate(body))

            def _json(self, status: int, data: dict) -> None:
                self._send(status, json.dumps(data).encode(), "application/json")

            def _send(self, status: int, payload: bytes, kind: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self.load_gate.set()
        self.server.shutdown()
        self.server.server_close()

    def metrics_page(self) -> str:
        running = ",".join(sorted(self.running_adapters))
        stale = f'max_lora="{self.max_lora}",waiting_lora_adapters="",running_lora_adapters="old"'
        now = (
            f'max_lora="{self.max_lora}",waiting_lora_adapters="",running_lora_adapters="{running}"'
        )
        return (
            "# HELP vllm:num_requests_running Running requests.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{engine="0"}} {self.running}\n'
            "# HELP vllm:num_requests_waiting Waiting requests.\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            'vllm:num_requests_waiting{engine="0"} 0\n'
            "# HELP vllm:lora_requests_info Running stats on lora requests.\n"
            "# TYPE vllm:lora_requests_info gauge\n"
            f"vllm:lora_requests_info{{{stale}}} 1.0e9\n"
            f"vllm:lora_requests_info{{{now}}} {time.time()}\n"
        )

    def model_list(self) -> dict:
        def card(name: str, parent: str | None, root: str) -> dict:
            return {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "epdserve",
                "root": root,
                "parent": parent,
                "max_model_len": None if parent else 2048,
                "permission": [],
            }

        with self._lock:
            names = list(self.adapters)
        cards = [card(BASE, None, "/models/tiny")]
        return {"object": "list", "data": cards + [card(n, BASE, f"/a/{n}") for n in names]}

    def load(self, body: dict) -> tuple[int, str]:
        with self._lock:
            self.loads.append(body)
        self.load_gate.wait(30)
        name = body["lora_name"]
        if self.load_error is not None:
            return self.load_error
        with self._lock:
            if name in self.adapters:
                return 400, f"lora_name: the LoRA adapter {name!r} has already been loaded"
            self.adapters.append(name)
        return 200, f"Success: LoRA adapter '{name}' added successfully."

    def generate(self, body: dict) -> tuple[int, dict]:
        model = body.get("model")
        if model not in (None, BASE, *self.adapters):
            return 404, error(404, f"The model `{model}` does not exist.", "model")
        answer = {"pod": self.name, "model": model, "object": "text_completion", "created": 0}
        answer["id"] = "cmpl-1"
        answer["choices"] = [{"index": 0, "text": self.name, "finish_reason": "length"}]
        if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
            answer["kv_transfer_params"] = {"remote_block_ids": [1], "from": self.name}
        return 200, answer


def error(status: int, message: str, param: str | None = None) -> dict:
    kind = {400: "BadRequestError", 404: "NotFoundError"}.get(status, "Error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def make_router(pods, policy=None, served: str | None = BASE, strategy: str = "prefix+load"):
    """A Router over ``pods`` (no event subscribers), named by the pods' names."""
    from epdserve.router.pods import PodEndpoint
    from epdserve.router.service import Router
    from epdserve.router.strategy import make_strategy

    router = Router(make_strategy(strategy), None, served, subscribe=False, lora_policy=policy)
    for pod in pods:
        router.add_pod(PodEndpoint(pod.name, pod.url, "tcp://127.0.0.1:9", None))
    return router


async def scrape(client, *routers) -> None:
    """One load scrape of every pod (gauges, and model lists when due)."""
    from epdserve.router.loadstats import scrape_once

    for router in routers:
        await scrape_once(client, router, 5.0)


async def send(client, router, body: dict, path: str = "/v1/completions") -> tuple[int, dict]:
    """One request the way the gateway forwards it: rank, place the adapter, open, read."""
    import asyncio

    from epdserve.router.lora_route import prepare
    from epdserve.router.proxy import ProxyError, open_upstream, read_all

    routing = await asyncio.to_thread(router.route, path, body)
    try:
        routing = await prepare(client, router, routing)
        upstream = await open_upstream(
            client, router, routing, "POST", path, json.dumps(body).encode(), {}, 3, 0.0
        )
        raw = await read_all(router, upstream)
    except ProxyError as exc:
        response = exc.response()
        return response.status_code, json.loads(response.body)
    return upstream.response.status_code, json.loads(raw)
