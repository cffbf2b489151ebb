"""Encoder-cache connectors: share vision-encoder outputs between pods by multimodal id."""

from epdserve.connectors.ec_connector.config import ECTransferConfig
from epdserve.connectors.ec_connector.connector import (
    ECConnector,
    ECConnectorScheduler,
    create_ec_connector,
)

__all__ = ["ECConnector", "ECConnectorScheduler", "ECTransferConfig", "create_ec_connector"]
