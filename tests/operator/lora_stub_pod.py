"""A small real HTTP server playing an engine pod's adapter routes for the operator's LoRA
tests: `GET /v1/models` (the base model, then one entry per adapter with `parent`),
`POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` in the pod's shapes, an optional
API key, and a journal of every call."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

BASE = "tiny"


class StubPod:
    """`with StubPod() as pod:` serves on 127.0.0.1:`pod.port` until the block ends."""

    def __init__(self, adapters: dict[str, str] | None = None, api_key: str | None = None):
        self.adapters = dict(adapters or {})  # name -> path
        self.api_key = api_key
        self.refuse: dict[str, str] = {}  # adapter name -> the 400 message a load gets
        self.calls: list[tuple[str, dict | None]] = []  # (path, body) of authorised calls
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> StubPod:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def changes(self) -> list[tuple[str, str]]:
        """(load|unload, adapter name) of every call that changed something, in order."""
        with self.lock:
            return [
                (path.rsplit("/", 1)[1].split("_")[0], body["lora_name"])
                for path, body in self.calls
                if body is not None
            ]

    def models(self) -> dict:
        entries = [{"id": BASE, "object": "model", "root": BASE, "parent": None}]
        entries += [
            {"id": n, "object": "model", "root": p, "parent": BASE}
            for n, p in sorted(self.adapters.items())
        ]
        return {"object": "list", "data": entries}

    def answer(self, path: str, body: dict | None) -> tuple[int, object]:
        """(status, JSON or text) for one authorised call."""
        with self.lock:
            self.calls.append((path, body))
            if path == "/v1/models":
                return 200, self.models()
            name = (body or {}).get("lora_name")
            if path == "/v1/load_lora_adapter":
                if name in self.refuse:
                    return 400, _error(self.refuse[name])
                if name in self.adapters:
                    return 400, _error(f"The lora adapter '{name}' has already been loaded.")
                self.adapters[name] = body["lora_path"]
                return 200, f"Success: LoRA adapter '{name}' added successfully."
            if path == "/v1/unload_lora_adapter":
                if self.adapters.pop(name, None) is None:
                    return 404, _error(f"The lora adapter '{name}' cannot be found.")
                return 200, f"Success: LoRA adapter '{name}' removed successfully."
            return 404, _error("Not Found")


def _error(message: str) -> dict:
    return {"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}}


def _handler(pod: StubPod):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # quiet test output
            pass

        def _serve(self, body: dict | None) -> None:
            if pod.api_key and self.headers.get("Authorization") != f"Bearer {pod.api_key}":
                status, payload = 401, _error("Unauthorized: missing or invalid API key")
            else:
                status, payload = pod.answer(self.path, body)
            text = payload if isinstance(payload, str) else json.dumps(payload)
            data = text.encode()
            self.send_response(status)
            kind = "text/plain" if isinstance(payload, str) else "application/json"
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802
            self._serve(None)

        def do_POST(self) -> None:  # noqa: N802
            length = int(self.headers.get("Content-Length") or 0)
            self._serve(json.loads(self.rfile.read(length) or b"{}"))

    return Handler
