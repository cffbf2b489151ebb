"""Pixels cross ZeroMQ once: the engine core keeps recent images' pixels, the API process
mirrors which ones, so a repeated image (or the 2nd..nth child of an ``n > 1`` request) is
sent as its identifier alone.

Both sides run the same LRU, bounded in bytes, and apply the same operation for each image
item of each request, in the order the requests travel over the one socket between them:
an item sent with pixels is put; an item sent without is touched (if present). The core
therefore holds exactly the items the API process believes it holds. An item the core does
not hold and gets without pixels (made by another pod, named in a processed prompt) is left
without: the encoder-output store has it, or the request fails naming the image.
"""

from __future__ import annotations

from collections import OrderedDict

from epdserve.engine.core.interfaces import MMFeature

DEFAULT_BYTES = 256 << 20


class PixelLRU:
    """Identifier -> (size in bytes, value); least recently used out first."""

    def __init__(self, capacity_bytes: int = DEFAULT_BYTES):
        self.capacity = capacity_bytes
        self.items: OrderedDict[str, tuple[int, object]] = OrderedDict()
        self.bytes = 0

    def __contains__(self, identifier: str) -> bool:
        return identifier in self.items

    def put(self, identifier: str, size: int, value=None) -> None:
        old = self.items.pop(identifier, None)
        if old is not None:
            self.bytes -= old[0]
        self.items[identifier] = (size, value)
        self.bytes += size
        while self.bytes > self.capacity and self.items:
            _, (gone, _) = self.items.popitem(last=False)
            self.bytes -= gone

    def touch(self, identifier: str):
        """The value if present (now most recently used), else None."""
        entry = self.items.get(identifier)
        if entry is None:
            return None
        self.items.move_to_end(identifier)
        return entry[1]


class PixelSender:
    """API-process side: which items go with pixels (see the module docstring)."""

    def __init__(self, capacity_bytes: int = DEFAULT_BYTES):
        self.lru = PixelLRU(capacity_bytes)

    def missing(self, items) -> list:
        """Items the core does not hold and whose pixels this process can make."""
        return [i for i in items if i.source is not None and i.identifier not in self.lru]

    def features(self, items) -> list[MMFeature]:
        """The request's features, updating the mirror; call right before sending them."""
        out = []
        for item in items:
            if self.lru.touch(item.identifier) is not None or item.source is None:
                out.append(MMFeature(item.identifier, item.offset, item.length, b"", []))
                continue
            pixels = item.pixels()
            data = pixels.tobytes()
            self.lru.put(item.identifier, len(data), True)
            out.append(
                MMFeature(item.identifier, item.offset, item.length, data, list(pixels.shape))
            )
        return out


class PixelReceiver:
    """Engine-core side: keeps pixels and fills in the ones sent as identifiers alone."""

    def __init__(self, capacity_bytes: int = DEFAULT_BYTES):
        self.lru = PixelLRU(capacity_bytes)

    def resolve(self, features: list[MMFeature]) -> None:
        for f in features:
            if f.data:
                self.lru.put(f.identifier, len(f.data), (f.data, f.shape, f.dtype))
                continue
            held = self.lru.touch(f.identifier)
            if held is not None:
                f.data, f.shape, f.dtype = held
