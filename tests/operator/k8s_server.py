"""Run an :class:`ApiEmulator` on a free loopback port in a background thread.

with EmulatorThread(tmp_path) as api:      # writes tmp_path/kubeconfig
    os.environ["KUBECONFIG"] = str(api.kubeconfig)
    api.emulator.store ...                  # read freely; mutate via api.call(fn, ...)
"""

from __future__ import annotations

import asyncio
import socket
import threading
from pathlib import Path

import kmock
import yaml
from k8s_emulator import ApiEmulator


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_kubeconfig(path: Path, server: str, namespace: str = "default") -> Path:
    """A kubeconfig with one plain-HTTP cluster and no credentials."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "emulator", "cluster": {"server": server}}],
        "users": [{"name": "tester", "user": {}}],
        "contexts": [
            {
                "name": "emulator",
                "context": {"cluster": "emulator", "user": "tester", "namespace": namespace},
            }
        ],
        "current-context": "emulator",
    }
    path.write_text(yaml.safe_dump(config))
    return path


class EmulatorThread:
    """An ApiEmulator served over HTTP from its own thread and event loop."""

    def __init__(self, workdir: Path, port: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.kubeconfig = write_kubeconfig(Path(workdir) / "kubeconfig", self.url)
        self.emulator = ApiEmulator()
        self.loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="k8s-emulator", daemon=True)

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # reported by start()
            self._error = exc
            self._ready.set()

    async def _serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        server = kmock.Server(self.emulator, host="127.0.0.1", port=self.port)
        async with self.emulator, server:
            self._ready.set()
            await self._stop.wait()
            self.emulator.cut_watches()  # let open watch streams end before the server goes

    def start(self) -> EmulatorThread:
        """Start serving; returns once the port accepts connections."""
        self._thread.start()
        if not self._ready.wait(30) or self._error is not None:
            raise RuntimeError(f"emulator did not start: {self._error!r}")
        return self

    def stop(self) -> None:
        """Stop serving and join the thread."""
        if self.loop is not None and self._stop is not None and self._thread.is_alive():
            self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(15)

    def call(self, fn, *args, timeout: float = 10, **kwargs):
        """Run `fn(*args, **kwargs)` on the emulator's loop (safe for state changes)."""

        async def wrapper():
            return fn(*args, **kwargs)

        return asyncio.run_coroutine_threadsafe(wrapper(), self.loop).result(timeout)

    def __enter__(self) -> EmulatorThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
