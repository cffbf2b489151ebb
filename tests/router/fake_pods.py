"""In-process fake pods for the router's leg tests: real HTTP servers (stdlib, one thread
each) that record every body they get and answer what the test tells them.

(Imported by path from the tests, which run with ``--import-mode=importlib``.)"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

from epdserve.router.app import ProxySettings
from epdserve.router.disagg import DisaggRouters, handle
from epdserve.router.pods import PodEndpoint
from epdserve.router.service import Router
from epdserve.router.strategy import make_strategy

Answer = tuple[int, dict, dict]  # status, JSON body, extra headers


class FakePod:
    """One pod: ``answer(path, body) -> (status, json, headers)``; ``bodies`` in arrival order."""

    def __init__(self, name: str, answer: Callable[[str, dict], Answer]) -> None:
        self.name, self.answer = name, answer
        self.bodies: list[tuple[str, dict]] = []
        pod = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:  # /metrics, /health: empty and fine
                self._send(200, b"", {"Content-Type": "text/plain"})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                pod.bodies.append((self.path, body))
                status, data, headers = pod.answer(self.path, body)
                self._send(status, json.dumps(data).encode(), headers)

            def _send(self, status: int, payload: bytes, headers: dict) -> None:
                self.send_response(status)
                for key, value in {"Content-Type": "application/json", **headers}.items():
                    self.send_header(key, value)
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
        self.server.shutdown()
        self.server.server_close()

    def paths(self) -> list[str]:
        return [path for path, _ in self.bodies]


def refusing_url() -> str:
    """A loopback address nothing listens on (connections are refused)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


class FakePool:
    """Per-role routers over fake pods; ``make`` returns ``(DisaggRouters, (encoders,
    prefills, decodes))`` where an answer given as a URL string is a dead pod (None)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.pods: list[FakePod] = []
        self.routers: list[Router] = []

    def make(self, encoders, prefills, decodes, strategy="prefix+load"):
        enc, enc_pods = self._role("encoder", encoders, "least-load")
        pre, pre_pods = self._role("prefill", prefills, strategy)
        dec, dec_pods = self._role("decode", decodes, strategy)
        return DisaggRouters(pre, dec, enc if encoders else None), (enc_pods, pre_pods, dec_pods)

    def _role(self, role: str, answers, strategy: str):
        router = Router(make_strategy(strategy), self.tokenizer, subscribe=False, engine_role=role)
        self.routers.append(router)
        pods = []
        for i, answer in enumerate(answers):
            pod = FakePod(f"{role}{i}", answer) if callable(answer) else None
            self.pods.extend([pod] if pod else [])
            url = pod.url if pod else answer
            router.add_pod(PodEndpoint(f"{role}{i}", url, "tcp://127.0.0.1:9", None))
            pods.append(pod)
        return router, pods

    def close(self) -> None:
        for pod in self.pods:
            pod.close()
        for router in self.routers:
            router.close()


def serve(routers: DisaggRouters, path: str, body: dict) -> tuple[int, bytes]:
    """One request through ``disagg.handle``: the client's status and body."""

    async def run():
        async with httpx.AsyncClient(timeout=10) as client:
            resp = await handle(client, routers, ProxySettings(), path, body, {})
            if hasattr(resp, "body_iterator"):
                return resp.status_code, b"".join([c async for c in resp.body_iterator])
            return resp.status_code, resp.body

    return asyncio.run(run())


# a prefill pod's answer (with a processed prompt, when given) and a decode pod's
PARAMS = {"remote_block_ids": [1, 2], "do_remote_prefill": True}


def prefill(prompt=None):
    def answer(path, body):
        out = {"kv_transfer_params": PARAMS}
        return 200, {**out, "processed_prompt": prompt} if prompt else out, {}

    return answer


def decode(path, body):
    return 200, {"answer": "decoded"}, {}
