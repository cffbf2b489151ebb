"""Who sent a request: tenants, their weights, and the keys or gateway header naming them.

A tenant-keys file (JSON or YAML, typically a Kubernetes Secret mounted as a file)::

    tenants:
      - {name: team-a, weight: 3, priority: 0, keys: ["sk-a1", "sha256:<hex>"]}
      - {name: batch, weight: 1, keys: ["sk-b1"]}

Keys are held only as sha256 digests (a ``sha256:<hex>`` entry is taken as one, so the
Secret need not hold the key itself); a presented key is hashed and looked up, so no
comparison runs over the secret bytes. A tenant with keys is named only by one of them: the
trusted gateway header cannot name it. Tenant names are label-safe (1-63 characters of
``[A-Za-z0-9._-]``, starting alphanumeric); metrics label at most ``MAX_LABELS`` distinct
tenants and fold the rest into ``other``, so a gateway header cannot grow the label set.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

log = logging.getLogger(__name__)

DEFAULT = "default"  # requests no key or header names
DEFAULT_PRIORITY = 0  # --tenant-priority: tenants without a configured one (the engines' default)
OTHER = "other"  # the metrics label of tenants past MAX_LABELS
MAX_LABELS = 64
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
HEX = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class Tenant:
    """One tenant: its fair share ``weight`` and, optionally, an engine ``priority``."""

    name: str
    weight: float = 1.0
    priority: int | None = None

    @property
    def engine_priority(self) -> int:
        """The ``priority`` its requests carry under ``--tenant-priority``."""
        return DEFAULT_PRIORITY if self.priority is None else self.priority


def valid_name(name: str) -> bool:
    return bool(NAME.match(name))


def key_digest(key: str | bytes) -> bytes:
    raw = key.encode() if isinstance(key, str) else key
    return hashlib.sha256(raw).digest()


class TenantTable:
    """Tenants by name and by key digest; built from a parsed file (``load``)."""

    def __init__(self, tenants: list[Tenant], keys: dict[bytes, str]) -> None:
        self.by_name = {t.name: t for t in tenants}
        self.by_digest = dict(keys)
        self.keyed = frozenset(keys.values())  # tenants a header may not name

    @classmethod
    def empty(cls) -> TenantTable:
        return cls([], {})

    @classmethod
    def load(cls, path: str) -> TenantTable:
        """Read ``--tenant-keys``; a ValueError names the file and the bad field."""
        try:
            text = Path(path).read_text()
            data = json.loads(text) if text.lstrip().startswith("{") else yaml.safe_load(text)
        except (OSError, ValueError, yaml.YAMLError) as exc:
            raise ValueError(f"--tenant-keys {path}: cannot read: {exc}") from exc
        return cls.parse(data, f"--tenant-keys {path}")

    @classmethod
    def parse(cls, data, where: str = "tenants") -> TenantTable:
        """Check and build from ``{tenants: [{name, weight, priority, keys}]}``."""
        if not isinstance(data, dict) or not isinstance(data.get("tenants"), list):
            raise ValueError(f"{where}: expected a mapping with a 'tenants' list")
        tenants, keys = [], {}
        for i, item in enumerate(data["tenants"]):
            at = f"{where}: tenants[{i}]"
            tenant = _tenant(item, at)
            if tenant.name in {t.name for t in tenants}:
                raise ValueError(f"{at}.name: duplicate tenant {tenant.name!r}")
            tenants.append(tenant)
            for j, key in enumerate(item.get("keys") or []):
                digest = _digest(key, f"{at}.keys[{j}]")
                if digest in keys:
                    raise ValueError(f"{at}.keys[{j}]: key already given to {keys[digest]!r}")
                keys[digest] = tenant.name
        return cls(tenants, keys)

    def current(self) -> TenantTable:
        """Itself (a ``TenantFile`` answers its latest table)."""
        return self

    def tenant(self, name: str) -> Tenant:
        """The configured tenant, or one of weight 1 (header tenants not in the file)."""
        return self.by_name.get(name) or Tenant(name)

    def by_key(self, key: bytes) -> Tenant | None:
        """The tenant owning ``key`` (None: not a tenant key)."""
        name = self.by_digest.get(key_digest(key))
        return None if name is None else self.by_name[name]


def _tenant(item, at: str) -> Tenant:
    if not isinstance(item, dict):
        raise ValueError(f"{at}: expected a mapping")
    unknown = set(item) - {"name", "weight", "priority", "keys"}
    if unknown:
        raise ValueError(f"{at}: unknown field(s) {sorted(unknown)}")
    name = item.get("name")
    if not isinstance(name, str) or not valid_name(name):
        raise ValueError(f"{at}.name: must be 1-63 characters of [A-Za-z0-9._-], got {name!r}")
    weight = item.get("weight", 1)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight <= 1e6:
        raise ValueError(f"{at}.weight: must be a number in (0, 1e6], got {weight!r}")
    priority = item.get("priority")
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
        raise ValueError(f"{at}.priority: must be an integer, got {priority!r}")
    if not isinstance(item.get("keys") or [], list):
        raise ValueError(f"{at}.keys: must be a list")
    return Tenant(name, float(weight), priority)


def _digest(key, at: str) -> bytes:
    if not isinstance(key, str) or not key or len(key) > 1024 or not key.isprintable():
        raise ValueError(f"{at}: must be a printable string of 1-1024 characters")
    if key.startswith("sha256:"):
        hexed = key[len("sha256:") :].lower()
        if not HEX.match(hexed):
            raise ValueError(f"{at}: sha256: must be followed by 64 hex digits")
        return bytes.fromhex(hexed)
    return key_digest(key)


class TenantFile:
    """``--tenant-keys``, read again when it changes (checked at most every ``check_s``): a
    Secret's update reaches its mounted file, so keys rotate without a restart. A file that
    no longer parses keeps the last good table (logged, and counted by ``on_error``)."""

    def __init__(self, path: str, check_s: float = 5.0) -> None:
        self.path, self.check_s = path, check_s
        self.on_error = lambda: None
        self._table = TenantTable.load(path)
        self._stamp = self._stat()
        self._next = time.monotonic() + check_s

    @property
    def by_name(self) -> dict[str, Tenant]:
        return self.current().by_name

    def current(self) -> TenantTable:
        now = time.monotonic()
        if now < self._next:
            return self._table
        self._next = now + self.check_s
        stamp = self._stat()
        if stamp != self._stamp:
            self._stamp = stamp  # a bad file is reported once, not at every check
            try:
                self._table = TenantTable.load(self.path)
                log.info("tenant keys reloaded from %s", self.path)
            except ValueError as exc:
                log.error("tenant keys not reloaded, the last good ones stay: %s", exc)
                self.on_error()
        return self._table

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)  # follows the Secret volume's ..data symlink
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size


class TenantLabels:
    """Metric labels of tenant names: the first ``limit`` distinct names keep their own,
    later ones share ``other`` (configured tenants always keep theirs)."""

    def __init__(self, configured=(), limit: int = MAX_LABELS) -> None:
        self.configured = frozenset(configured)
        self.limit = limit
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, name: str) -> str:
        if name in self.configured or name in self._seen:
            return name
        with self._lock:
            if len(self._seen) < self.limit:
                self._seen.add(name)
                return name
        return OTHER


class BadTenantHeader(ValueError):
    """The trusted gateway's tenant header holds no valid tenant name (a 400)."""


class KeyedTenantHeader(ValueError):
    """The gateway header names a tenant that has keys: only its keys name it (a 403)."""


@dataclass(frozen=True)
class Identity:
    """How the router names a request's tenant (``--tenant-keys``, ``--tenant-header``,
    ``--api-key``). ``identify`` answers the tenant or None (401)."""

    table: TenantTable | TenantFile
    header: bytes | None = None  # lowercased header name set by a trusted gateway
    api_key: bytes | None = None  # the shared key: the default (or the header's) tenant

    def needs_key(self, table: TenantTable) -> bool:
        """A key is required: some tenant has one, or ``--api-key`` is set."""
        return bool(table.by_digest) or self.api_key is not None

    def identify(self, token: bytes | None, header_value: bytes | None) -> Tenant | None:
        """A key rules: a tenant key names its tenant; the shared key, or no key when none
        is required, leaves the choice to the gateway header, else the default tenant.
        None: a key is required and ``token`` is not one of them. Raises BadTenantHeader,
        and KeyedTenantHeader when the header names a tenant that has keys (else the shared
        key would take that tenant's weight and priority)."""
        table = self.table.current()
        if self.needs_key(table):
            tenant = table.by_key(token) if token else None
            if tenant is not None:
                return tenant
            shared = self.api_key is not None and hmac.compare_digest(token or b"", self.api_key)
            if not shared:
                return None
        if self.header is not None and header_value:
            name = header_value.decode("latin-1").strip()
            if not valid_name(name):
                raise BadTenantHeader(
                    f"{self.header.decode()} must be 1-63 characters of "
                    "[A-Za-z0-9._-] starting with a letter or digit"
                )
            if name in table.keyed:
                raise KeyedTenantHeader(
                    f"{self.header.decode()} names tenant {name!r}, which has its own keys: "
                    "present one of them instead"
                )
            return table.tenant(name)
        return table.tenant(DEFAULT)
