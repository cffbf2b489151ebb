"""CurveZMQ keys for the KV-event sockets, read from a mounted directory.

Engine side (``--kv-events-curve-dir``): ``server.public`` and ``server.secret`` (the pod's
key pair) and ``client.public`` (the public keys allowed to connect, one per line). Router
side: ``client.public``, ``client.secret`` and ``server.public``. Every key is Z85 text
(40 characters, what ``zmq.curve_keypair()`` returns); surrounding whitespace is ignored.
The engine's PUB and replay ROUTER become Curve servers whose ZAP handler admits only the
listed client keys; the router's SUB and replay DEALER are Curve clients.
"""

from __future__ import annotations

import logging
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

log = logging.getLogger(__name__)

CURVE_DIR_ENV = "EPDSERVE_KV_EVENTS_CURVE_DIR"
ZAP_DOMAIN = "epdserve-kv-events"


class CurveKeyError(ValueError):
    """A key file that is missing or not a Z85 Curve key (the message names the file)."""


@dataclass(frozen=True)
class CurveServerKeys:
    """An engine pod's key pair and the client keys it admits (Z85 bytes)."""

    public: bytes
    secret: bytes
    allowed_clients: frozenset[bytes]

    @classmethod
    def load(cls, directory: str | Path) -> CurveServerKeys:
        d = Path(directory)
        public, secret = _read_key(d / "server.public"), _read_key(d / "server.secret")
        _check_pair(d / "server.public", public, d / "server.secret", secret)
        allowed = _read_key_list(d / "client.public")
        return cls(public, secret, frozenset(allowed))


@dataclass(frozen=True)
class CurveClientKeys:
    """The router's key pair and the engine pods' public key (Z85 bytes)."""

    public: bytes
    secret: bytes
    server_public: bytes

    @classmethod
    def load(cls, directory: str | Path) -> CurveClientKeys:
        d = Path(directory)
        public, secret = _read_key(d / "client.public"), _read_key(d / "client.secret")
        _check_pair(d / "client.public", public, d / "client.secret", secret)
        return cls(public, secret, _read_key(d / "server.public"))

    def apply(self, socket: zmq.Socket) -> None:
        """Make ``socket`` a Curve client of the engine pods (before it connects)."""
        socket.curve_serverkey = self.server_public
        socket.curve_publickey = self.public
        socket.curve_secretkey = self.secret


class CurveServer:
    """A ZAP handler in one context that admits only the allowed client keys, and the
    socket options that make a socket of that context a Curve server."""

    def __init__(self, keys: CurveServerKeys, context: zmq.Context, stats=None) -> None:
        self.keys = keys
        self._stats = stats  # its ``auth_denied`` counts refused handshakes
        self.denied = 0
        self._warned: set[bytes] = set()
        self._lock = threading.Lock()
        self._auth = ThreadAuthenticator(context, log=logging.getLogger(__name__ + ".zap"))
        self._auth.start()
        self._auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=self)

    def callback(self, domain: str, client_key: bytes) -> bool:
        """ZAP: is this Z85 client key allowed? (called on the authenticator's thread)"""
        if domain == ZAP_DOMAIN and client_key in self.keys.allowed_clients:
            return True
        with self._lock:
            self.denied += 1
            if self._stats is not None:
                self._stats.auth_denied += 1
            first = client_key not in self._warned and len(self._warned) < 64
            self._warned.add(client_key)
        if first:  # a peer retries every reconnect interval: warn once per key
            log.warning("KV events: refused a Curve client with an unlisted public key")
        return False

    def apply(self, socket: zmq.Socket) -> None:
        """Make ``socket`` a Curve server checked by this handler (before it binds)."""
        socket.curve_secretkey = self.keys.secret
        socket.curve_publickey = self.keys.public
        socket.curve_server = True
        socket.zap_domain = ZAP_DOMAIN.encode()
        # no handler must mean no access, never encryption without authentication
        socket.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)

    def stop(self) -> None:
        self._auth.stop()


def _read_key(path: Path) -> bytes:
    try:
        text = path.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        raise CurveKeyError(f"Curve key file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CurveKeyError(f"Curve key file {path} cannot be read: {exc}") from None
    return _parse_key(text, str(path))


def _read_key_list(path: Path) -> list[bytes]:
    try:
        lines = path.read_text(encoding="ascii").splitlines()
    except FileNotFoundError:
        raise CurveKeyError(f"Curve key file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CurveKeyError(f"Curve key file {path} cannot be read: {exc}") from None
    keys = [
        _parse_key(line.strip(), f"{path} line {n}")
        for n, line in enumerate(lines, start=1)
        if line.strip()  # no comment syntax: "#" is a Z85 character a key may start with
    ]
    if not keys:
        raise CurveKeyError(f"Curve key file {path} lists no public key")
    return keys


def _parse_key(text: str, where: str) -> bytes:
    key = text.encode("ascii")
    if len(key) != 40:
        raise CurveKeyError(f"Curve key in {where}: expected 40 Z85 characters, got {len(key)}")
    try:
        z85.decode(key)
    except (ValueError, KeyError, IndexError, struct.error):
        raise CurveKeyError(f"Curve key in {where}: not Z85 text") from None
    return key


def _check_pair(public_path: Path, public: bytes, secret_path: Path, secret: bytes) -> None:
    if zmq.curve_public(secret) != public:
        raise CurveKeyError(f"Curve keys {secret_path} and {public_path} are not one key pair")
