"""A userspace service proxy (what kube-proxy's old `userspace` mode did).

Each ClusterIP Service port gets a listener on `cluster IP:port` (the IP lives on the pod
bridge); every accepted connection is piped to one of the Service's ready endpoints, round
robin. A listener with no ready endpoint closes new connections at once, as a cluster
answers a Service without endpoints. The `kubernetes` Service is served the same way but
terminates TLS in front of the plain-HTTP API emulator, so pods use in-cluster config.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import ssl
import threading

from events import EVENTS


class ServiceProxy:
    """Listeners keyed by (ip, port); backends replaced as EndpointSlices change."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self._servers: dict[tuple[str, int], asyncio.AbstractServer] = {}
        self._backends: dict[tuple[str, int], list[tuple[str, int]]] = {}
        self._names: dict[tuple[str, int], str] = {}
        self._turn = itertools.count()
        self._conns: set[asyncio.Task] = set()
        self._thread = threading.Thread(target=self.loop.run_forever, name="svc-proxy", daemon=True)
        self._thread.start()

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(15)

    def set_backends(
        self, ip: str, port: int, backends, tls: ssl.SSLContext | None = None, name: str = ""
    ):
        """Serve ip:port, forwarding to `backends` [(ip, port), ...] from now on; `name`
        (namespace/service) labels what it logs."""
        backends = list(backends)
        self._names[ip, port] = name or f"{ip}:{port}"
        if self._backends.get((ip, port)) != backends:
            EVENTS.add("kube-proxy", f"{self._names[ip, port]} backends {backends}")
        self._backends[ip, port] = backends
        if (ip, port) not in self._servers:
            self._call(self._listen(ip, port, tls))

    def remove(self, ip: str, port: int) -> None:
        """Stop serving ip:port."""
        EVENTS.add("kube-proxy", f"{self._names.pop((ip, port), (ip, port))} no longer served")
        self._backends.pop((ip, port), None)
        server = self._servers.pop((ip, port), None)
        if server is not None:
            self._call(_close_server(server))

    def ports(self) -> set[tuple[str, int]]:
        return set(self._servers)

    def serves(self, ip: str) -> bool:
        """Whether some port of cluster IP `ip` is forwarded to a ready endpoint."""
        return any(backends for (addr, _), backends in list(self._backends.items()) if addr == ip)

    async def _listen(self, ip: str, port: int, tls) -> None:
        async def handle(reader, writer):
            task = asyncio.current_task()
            self._conns.add(task)
            try:
                await self._forward(ip, port, reader, writer)
            finally:
                self._conns.discard(task)

        self._servers[ip, port] = await asyncio.start_server(
            handle, ip, port, ssl=tls, reuse_address=True
        )

    async def _forward(self, ip: str, port: int, reader, writer) -> None:
        backends = self._backends.get((ip, port)) or []
        where = self._names.get((ip, port))
        upstream = None
        for _ in range(len(backends)):
            host, bport = backends[next(self._turn) % len(backends)]
            try:
                upstream = await asyncio.wait_for(asyncio.open_connection(host, bport), 5)
                break
            except (OSError, TimeoutError) as exc:
                EVENTS.add("service-proxy", f"{where} -> {host}:{bport} failed: {exc!r}")
                continue
        if upstream is None:
            EVENTS.add("service-proxy", f"{where} closed a connection: no backend took it")
            writer.close()
            return
        up_reader, up_writer = upstream
        await asyncio.gather(
            _pipe(reader, up_writer), _pipe(up_reader, writer), return_exceptions=True
        )

    def close(self) -> None:
        """Close every listener and connection, then stop the loop's thread."""
        for key in list(self._servers):
            self.remove(*key)

        async def cancel_all():
            tasks = list(self._conns)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        self._call(cancel_all())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (OSError, asyncio.IncompleteReadError, ssl.SSLError):
        pass
    finally:
        with contextlib.suppress(OSError, RuntimeError):
            writer.close()


async def _close_server(server: asyncio.AbstractServer) -> None:
    server.close()


def tls_context(cert: str, key: str) -> ssl.SSLContext:
    """A server-side TLS context for the `kubernetes` Service."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    return ctx
