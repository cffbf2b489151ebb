"""``--kv-transfer-config``: which KV connector a pod runs and in which role (vLLM's JSON)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from epdserve.common.cli_fields import config_from

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
        if self.kv_connector_extra_config is None:  # JSON null: no extra config
            object.__setattr__(self, "kv_connector_extra_config", {})
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError("kv_transfer_config.kv_connector_extra_config: must be an object")
        KV_CONNECTORS[self.kv_connector].check_extra_config(self.kv_connector_extra_config)

    @classmethod
    def parse(cls, value: str | dict | KVTransferConfig | None) -> KVTransferConfig | None:
        """From the flag's JSON text (or a dict); every error names the offending key."""
        return config_from(cls, value, "kv_transfer_config", required=("kv_connector",))

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
