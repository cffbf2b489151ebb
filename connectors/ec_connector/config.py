"""``--ec-transfer-config`` (vLLM's keys): which encoder-cache connector, which role, where."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from epdserve.common.cli_fields import config_from

CONNECTORS = {"RedisECConnector": "url", "SharedStorageECConnector": "path"}
ROLES = ("ec_producer", "ec_consumer", "ec_both")


@dataclass(frozen=True)
class ECTransferConfig:
    """``{"ec_connector": NAME, "ec_role": ROLE, "ec_connector_extra_config": {...}}``."""

    ec_connector: str
    ec_role: str = "ec_both"
    ec_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.ec_connector not in CONNECTORS:
            raise ValueError(
                f"ec_transfer_config.ec_connector: must be one of "
                f"{', '.join(CONNECTORS)}, got {self.ec_connector!r}"
            )
        if self.ec_role not in ROLES:
            raise ValueError(
                f"ec_transfer_config.ec_role: must be one of {', '.join(ROLES)}, "
                f"got {self.ec_role!r}"
            )
        extra = self.ec_connector_extra_config
        if extra is None:  # JSON null: no extra config
            extra = {}
            object.__setattr__(self, "ec_connector_extra_config", extra)
        if not isinstance(extra, dict):
            raise ValueError("ec_transfer_config.ec_connector_extra_config: must be an object")
        if not extra.get(CONNECTORS[self.ec_connector]):
            raise ValueError(
                f"ec_transfer_config.ec_connector_extra_config.{CONNECTORS[self.ec_connector]}: "
                f"required by {self.ec_connector}"
            )

    @classmethod
    def parse(cls, value: str | dict | ECTransferConfig | None) -> ECTransferConfig | None:
        """From the flag's JSON text (or a dict); every error names the key."""
        return config_from(cls, value, "ec_transfer_config", required=("ec_connector",))

    @property
    def is_producer(self) -> bool:
        return self.ec_role in ("ec_producer", "ec_both")

    @property
    def is_consumer(self) -> bool:
        return self.ec_role in ("ec_consumer", "ec_both")

    @property
    def pool(self) -> str:
        return str(self.ec_connector_extra_config.get("pool", "default"))

    def storage_options(self) -> dict[str, Any]:
        """The store's settings: the extra config less the keys the connector reads."""
        return {k: v for k, v in self.ec_connector_extra_config.items() if k != "pool"}
