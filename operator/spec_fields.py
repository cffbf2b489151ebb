"""Readers of spec fields that several sections of an InferencePool share (pure): resource
requirements, byte quantities and Secret references, each refused with the field's path."""

from __future__ import annotations

from epdserve.operator.errors import InvalidSpec
from epdserve.operator.quantity import parse_bytes


def resources(raw: dict | None) -> dict:
    """Quantities as strings, as the API server returns them (`1` -> `"1"`)."""
    return {
        kind: {name: str(q) for name, q in (values or {}).items()}
        for kind, values in (raw or {}).items()
        if kind in ("requests", "limits")
    }


def byte_size(value, where: str) -> int | None:
    """A positive byte quantity of the spec, or None when unset."""
    if value is None:
        return None
    try:
        size = parse_bytes(value)
    except ValueError as exc:
        raise InvalidSpec(f"{where}: {exc}") from None
    if size <= 0:
        raise InvalidSpec(f"{where}: must be more than 0 bytes, got {value!r}")
    return size


def secret_ref(raw: dict | None, default_key: str, where: str) -> tuple[str, str] | None:
    """(secret name, key) of a `{name, key}` reference, or None when unset."""
    if not raw:
        return None
    if not raw.get("name"):
        raise InvalidSpec(f"{where}.name is required")
    return raw["name"], raw.get("key") or default_key
