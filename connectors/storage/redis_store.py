"""Redis backend: whole values per key, pipelined in chunks over a pooled hiredis client."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import quote, urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.connection import Encoder, PythonRespSerializer
from redis.retry import Retry

from epdserve.connectors.storage.base import BlockStore, CircuitBreaker, StoreStats

logger = logging.getLogger(__name__)

PASSWORD_ENV = "EPDSERVE_REDIS_PASSWORD"


@dataclass(frozen=True)
class RedisStoreConfig:
    """Where and how to reach Redis. ``redis://`` or ``rediss://`` (TLS) URLs."""

    url: str = "redis://127.0.0.1:6379/0"
    password: str | None = None  # used only when the URL has none; else $EPDSERVE_REDIS_PASSWORD
    ttl_s: float | None = None  # expire stored values (None: rely on Redis' maxmemory policy)
    socket_timeout_s: float = 2.0
    connect_timeout_s: float = 1.0
    max_connections: int = 32
    chunk_keys: int = 64  # keys per pipeline round trip
    chunk_bytes: int = 16 << 20  # value bytes per pipeline round trip (puts)
    backoff_initial_s: float = 0.5  # first "down" period after a fault; doubles per fault
    backoff_max_s: float = 30.0
    max_value_bytes: int = 256 << 20  # larger values read back are rejected

    def __post_init__(self) -> None:
        resolve_redis_url(self.url)  # checks the scheme
        for name in _POSITIVE_FIELDS:
            _positive(name, getattr(self, name))
        if self.ttl_s is not None:
            _positive("ttl_s", self.ttl_s)
        if self.backoff_initial_s < 0:
            raise ValueError(f"backoff_initial_s must be >= 0, got {self.backoff_initial_s}")


_POSITIVE_FIELDS = (
    "socket_timeout_s",
    "connect_timeout_s",
    "max_connections",
    "chunk_keys",
    "chunk_bytes",
    "max_value_bytes",
    "backoff_max_s",
)


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")


def resolve_redis_url(url: str, password: str | None = None) -> str:
    """``url`` with ``password`` (or ``$EPDSERVE_REDIS_PASSWORD``) merged in if it has none."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ValueError(f"url must be redis://, rediss:// or unix://, got scheme {parts.scheme!r}")
    password = password or os.environ.get(PASSWORD_ENV)
    if parts.password is not None or not password or parts.scheme == "unix":
        return url
    user = quote(parts.username, safe="") if parts.username else ""
    netloc = f"{user}:{quote(password, safe='')}@{parts.netloc.rpartition('@')[2]}"
    return urlunsplit(parts._replace(netloc=netloc))


def redact_url(url: str) -> str:
    """The URL without its password, for logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))


class RedisBlockStore(BlockStore):
    """Stores each value as one Redis string; batches go out as pipelines of GET/SET."""

    def __init__(self, config: RedisStoreConfig):
        self.config = config
        self.stats = StoreStats()
        self.breaker = CircuitBreaker(config.backoff_initial_s, config.backoff_max_s)
        self.pool = redis.ConnectionPool.from_url(
            resolve_redis_url(config.url, config.password),
            max_connections=config.max_connections,
            socket_timeout=config.socket_timeout_s,
            socket_connect_timeout=config.connect_timeout_s,
            retry=Retry(NoBackoff(), 0),  # our breaker decides when to try again
            # hiredis' packer copies every value into one command buffer; the pure-Python one
            # sends large values as they are (replies are still parsed by hiredis).
            command_packer=PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode),
        )
        self.client = redis.Redis(connection_pool=self.pool)
        self._last_error_kind = ""

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> list[bool]:
        done = [False] * len(items)
        px = int(self.config.ttl_s * 1000) if self.config.ttl_s else None
        for start, stop in self._chunks([len(v) for _, v in items]):
            batch = items[start:stop]
            results = self._pipeline(
                lambda p, b=batch: [p.set(k, v, px=px) for k, v in b], len(batch)
            )
            for i, ok in enumerate(results or (), start):
                done[i] = ok is True
                if isinstance(ok, Exception):  # per command: OOM, NOAUTH, READONLY replica...
                    self._command_error(ok)
        stored = sum(done)
        self.stats.add(puts=stored, put_failures=len(items) - stored)
        return done

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        values: list[bytes | None] = [None] * len(keys)
        failed, refused = 0, []
        for start, stop in self._chunks([0] * len(keys)):
            results = self._pipeline(
                lambda p, b=keys[start:stop]: [p.get(k) for k in b], stop - start
            )
            if results is None:
                failed += stop - start
            for i, value in enumerate(results or (), start):
                values[i] = self._valid(value)
                if values[i] is None and _unusable(value, self.config.max_value_bytes):
                    refused.append(keys[i])
                elif isinstance(value, Exception):  # LOADING, NOAUTH...: a fault, not the value
                    failed += 1
        hits = sum(v is not None for v in values)
        self.stats.add(gets=len(keys), hits=hits, get_failures=failed, rejected=len(refused))
        if refused:  # it would be read, and refused, again by every pod
            self.delete_many(refused)
        return values

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        found = [False] * len(keys)
        for start, stop in self._chunks([0] * len(keys)):
            results = self._pipeline(
                lambda p, b=keys[start:stop]: [p.exists(k) for k in b], stop - start
            )
            for i, n in enumerate(results or (), start):
                found[i] = n == 1
        return found

    def delete_many(self, keys: Sequence[str]) -> int:
        deleted = 0
        for start, stop in self._chunks([0] * len(keys)):
            results = self._pipeline(lambda p, b=keys[start:stop]: p.delete(*b), stop - start)
            deleted += sum(n for n in results or () if isinstance(n, int))
        return deleted

    def close(self) -> None:
        self.client.close()
        self.pool.disconnect()

    def _chunks(self, sizes: list[int]):
        """``(start, stop)`` ranges of at most ``chunk_keys`` keys and about ``chunk_bytes``."""
        start, total = 0, 0
        for i, size in enumerate(sizes):
            if i > start and (
                i - start >= self.config.chunk_keys or total + size > self.config.chunk_bytes
            ):
                yield start, i
                start, total = i, 0
            total += size
        if start < len(sizes):
            yield start, len(sizes)

    def _pipeline(self, queue, num_keys: int) -> list | None:
        """Run one pipeline built by ``queue(pipe)`` (touching ``num_keys`` keys); per-command
        errors come back in place as exceptions. ``None`` on a fault or while the breaker is open."""
        if not self.breaker.allow():
            self.stats.add(skipped=num_keys)
            return None
        try:
            with self.client.pipeline(transaction=False) as pipe:
                queue(pipe)
                n = len(pipe)
                results = pipe.execute(raise_on_error=False)
            if not isinstance(results, list) or len(results) != n:
                raise redis.exceptions.InvalidResponse(f"{n} commands, replies: {results!r:.80}")
        except (redis.RedisError, OSError) as exc:  # down, slow, or replies the parser can't read
            self._fault(exc)
            return None
        if self.breaker.record_success():
            self.stats.add(reconnects=1)
            logger.info("redis %s is reachable again", redact_url(self.config.url))
        return results

    def _fault(self, exc: Exception) -> None:
        was_down = self.breaker.is_down
        self.breaker.record_failure()
        self.pool.disconnect(inuse_connections=False)  # idle sockets are likely dead too
        log = logger.debug if was_down else logger.warning
        log("redis %s failed (%s: %s)", redact_url(self.config.url), type(exc).__name__, exc)

    def _command_error(self, exc: Exception) -> None:
        """Log a per-command error the first time its kind shows up (they are counted)."""
        kind = str(exc).split(" ", 1)[0]
        if kind != self._last_error_kind:
            self._last_error_kind = kind
            logger.warning("redis %s refused a command: %s", redact_url(self.config.url), exc)

    def _valid(self, value) -> bytes | None:
        if isinstance(value, Exception):  # e.g. WRONGTYPE: the key holds something else
            self._command_error(value)
        if not isinstance(value, bytes) or len(value) > self.config.max_value_bytes:
            return None
        return value


def _unusable(value, max_bytes: int) -> bool:
    """A reply no read of this key will ever accept: too long, or not a string (WRONGTYPE);
    other per-command errors (LOADING, NOAUTH...) say nothing about the value."""
    if isinstance(value, bytes):
        return len(value) > max_bytes
    return isinstance(value, redis.ResponseError) and str(value).startswith("WRONGTYPE")
