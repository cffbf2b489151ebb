"""``--ec-transfer-config`` (vLLM's keys): which encoder-cache connector, which role, where."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

CONNECTORS = {"RedisECConnector": "url", "SharedStorageECConnector": "path"}
ROLES = ("ec_producer", "ec_consumer", "ec_both")


@dataclass(frozen=True)
class ECTransferConfig:
    ec_connector: str
    ec_role: str
    extra: dict = field(default_factory=dict)

    @property
    def is_producer(self) -> bool:
        return self.ec_role in ("ec_producer", "ec_both")

    @property
    def is_consumer(self) -> bool:
        return self.ec_role in ("ec_consumer", "ec_both")

    @property
    def pool(self) -> str:
        return str(self.extra.get("pool", "default"))

    @classmethod
    def from_json(cls, text: str) -> ECTransferConfig:
        """Parse and validate; every error names the key."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"ec_transfer_config: not valid JSON ({exc.msg})") from exc
        if not isinstance(data, dict):
            raise ValueError("ec_transfer_config: must be a JSON object")
        unknown = set(data) - {"ec_connector", "ec_role", "ec_connector_extra_config"}
        if unknown:
            raise ValueError(f"ec_transfer_config.{sorted(unknown)[0]}: unknown key")
        name = data.get("ec_connector")
        if name not in CONNECTORS:
            raise ValueError(
                f"ec_transfer_config.ec_connector: must be one of "
                f"{', '.join(CONNECTORS)}, got {name!r}"
            )
        role = data.get("ec_role", "ec_both")
        if role not in ROLES:
            raise ValueError(
                f"ec_transfer_config.ec_role: must be one of {', '.join(ROLES)}, got {role!r}"
            )
        extra = data.get("ec_connector_extra_config") or {}
        if not isinstance(extra, dict):
            raise ValueError("ec_transfer_config.ec_connector_extra_config: must be an object")
        if not extra.get(CONNECTORS[name]):
            raise ValueError(
                f"ec_transfer_config.ec_connector_extra_config.{CONNECTORS[name]}: "
                f"required by {name}"
            )
        return cls(name, role, dict(extra))
