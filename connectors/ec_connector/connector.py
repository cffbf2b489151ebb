"""The encoder-cache connector in two halves. ``ECConnector`` moves the outputs (the worker
half, or an encoder pod's only one): ``stored`` (the encoder pod, before encoding),
``save_caches`` and ``start_load_caches`` over a ``BlockStore``. ``ECConnectorScheduler`` is
what the scheduler needs (whether this pod consumes stored outputs) and opens no store. Consumers load without asking first: one GET
per item, a miss is encoded (or fails the request of an image the pod never got). A store fault, or a stored output
that fails verification (then deleted), is a miss: the pod encodes the image itself, and the
miss is counted."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from epdserve.connectors.ec_connector.config import ECTransferConfig
from epdserve.connectors.storage import create_store
from epdserve.connectors.storage.transfer import EncoderOutputIO, rejection_counts


class ECConnectorScheduler:
    """The scheduler half: decides which encoder inputs a step loads rather than encodes."""

    def __init__(self, config: ECTransferConfig):
        self.config = config

    @property
    def is_consumer(self) -> bool:
        return self.config.is_consumer

    def close(self) -> None:
        return None


class ECConnector:
    def __init__(self, config: ECTransferConfig, fingerprint: str):
        self.config = config
        self.store = create_store(config.storage_options())
        self.io = EncoderOutputIO(self.store, config.pool, fingerprint)
        self.loaded = self.load_failures = self.saved = 0

    def stored(self, mm_ids: Sequence[str]) -> list[bool]:
        """Whether each item is in the store, whatever the role (producers skip re-encoding)."""
        return self.io.has(list(mm_ids)) if mm_ids else []

    # worker side ---------------------------------------------------------------------
    def start_load_caches(
        self, mm_ids: Sequence[str], shapes: Sequence[tuple[int, ...]], dtype: torch.dtype
    ) -> list[torch.Tensor | None]:
        """Load outputs (None where the store no longer has a valid one)."""
        outs = self.io.load(list(mm_ids), list(shapes), dtype)
        ok = sum(o is not None for o in outs)
        self.loaded += ok
        self.load_failures += len(outs) - ok
        return outs

    def save_caches(self, outputs: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Store freshly computed outputs (producers only)."""
        if self.config.is_producer and outputs:
            self.saved += sum(self.io.save(list(outputs)))

    def rejections(self) -> dict[str, int]:
        """Stored outputs this pod refused (and deleted) since it started, by reason."""
        return rejection_counts(self.io, self.store)

    def close(self) -> None:
        self.store.close()


def create_ec_connector(config: ECTransferConfig | None, fingerprint: str) -> ECConnector | None:
    return None if config is None else ECConnector(config, fingerprint)
