"""Kubernetes resource quantities (`512Mi`, `2G`, `1e9`, `1500m`) as numbers (pure)."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_SUFFIXES = {
    "": 1,
    "m": Decimal("0.001"),
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
}
_QUANTITY = re.compile(
    r"^([+-]?(?:\d+(?:\.\d*)?|\.\d+))((?:[KMGTPE]i)|[mkMGTPE]|(?:[eE][+-]?\d+))?$"
)


def parse_quantity(value: int | float | str) -> Decimal:
    """The quantity's value; raises ValueError for text Kubernetes would not accept."""
    if isinstance(value, bool):
        raise ValueError(f"not a quantity: {value!r}")
    if isinstance(value, int | float):
        return Decimal(str(value))
    match = _QUANTITY.match(str(value).strip())
    if not match:
        raise ValueError(f"not a quantity: {value!r}")
    number, suffix = match.group(1), match.group(2) or ""
    try:
        if suffix[:1] in ("e", "E"):
            return Decimal(number) * Decimal(10) ** int(suffix[1:])
        return Decimal(number) * _SUFFIXES[suffix]
    except (InvalidOperation, KeyError) as exc:
        raise ValueError(f"not a quantity: {value!r}") from exc


def parse_bytes(value: int | float | str) -> int:
    """A memory/storage quantity in whole bytes (rounded down)."""
    return int(parse_quantity(value))
