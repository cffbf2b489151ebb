"""One connector object per pod: ``has_cache_item`` (scheduler side), ``save_caches`` and
``start_load_caches`` (worker side) over a ``BlockStore``. A store fault, or a stored output
that fails verification (then deleted), is a miss: the pod encodes the image itself, and the
miss is counted."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from epdserve.connectors.ec_connector.config import ECTransferConfig
from epdserve.connectors.storage import create_store
from epdserve.connectors.storage.transfer import EncoderOutputIO, rejection_counts


class ECConnector:
    def __init__(self, config: ECTransferConfig, fingerprint: str):
        self.config = config
        self.store = create_store(config.storage_options())
        self.io = EncoderOutputIO(self.store, config.pool, fingerprint)
        self.lookups = self.found = self.loaded = self.load_failures = self.saved = 0

    # scheduler side ------------------------------------------------------------------
    def has_cache_item(self, mm_ids: Sequence[str]) -> list[bool]:
        """Whether each item's encoder output is in the shared store (consumers only)."""
        if not self.config.is_consumer or not mm_ids:
            return [False] * len(mm_ids)
        found = self.io.has(list(mm_ids))
        self.lookups += len(mm_ids)
        self.found += sum(found)
        return found

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
