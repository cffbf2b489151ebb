"""``--kv-transfer-config``: which KV connector a pod runs and in which role (vLLM's JSON)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
CONNECTOR_KEYS = ("pool",)  # extra-config keys the connector itself reads; the rest go to storage


@dataclass(frozen=True)
class KVTransferConfig:
    """``{"kv_connector": NAME, "kv_role": ROLE, "kv_connector_extra_config": {...}}``."""

    kv_connector: str
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from epdserve.connectors.kv_connector.registry import KV_CONNECTORS

        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(
                f"kv_transfer_config.kv_connector: must be one of {', '.join(KV_CONNECTORS)}, "
                f"got {self.kv_connector!r}"
            )
        if self.kv_role not in KV_ROLES:
            raise ValueError(
                f"kv_transfer_config.kv_role: must be one of {', '.join(KV_ROLES)}, "
                f"got {self.kv_role!r}"
            )
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError("kv_transfer_config.kv_connector_extra_config: must be an object")
        KV_CONNECTORS[self.kv_connector].check_extra_config(self.kv_connector_extra_config)

    @classmethod
    def from_json(cls, text: str) -> KVTransferConfig:
        """Parse and validate; every error names the offending key."""
        try:
            raw = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"kv_transfer_config: not valid JSON ({exc})") from None
        if not isinstance(raw, dict):
            raise ValueError("kv_transfer_config: must be a JSON object")
        known = {"kv_connector", "kv_role", "kv_connector_extra_config"}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(
                f"kv_transfer_config.{unknown[0]}: unknown key; known: {sorted(known)}"
            )
        if "kv_connector" not in raw:
            raise ValueError("kv_transfer_config.kv_connector: required")
        return cls(
            raw["kv_connector"],
            raw.get("kv_role", "kv_both"),
            raw.get("kv_connector_extra_config") or {},
        )

    @property
    def is_producer(self) -> bool:
        """Saves the blocks it computes."""
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        """Looks up and loads blocks others computed."""
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def pool(self) -> str:
        return str(self.kv_connector_extra_config.get("pool", "default"))

    def storage_options(self) -> dict[str, Any]:
        return {k: v for k, v in self.kv_connector_extra_config.items() if k not in CONNECTOR_KEYS}
