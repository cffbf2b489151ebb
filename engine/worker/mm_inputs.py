"""Runner side of multimodal inputs: run the vision encoder, keep its outputs, and place
them at their placeholder positions in a step's input embeddings."""

from __future__ import annotations

import numpy as np
import torch

from epdserve.engine.core.interfaces import MissingPixelsError
from epdserve.engine.models.bidirectional import ImageSpans


class EncoderOutputs:
    """Encoder outputs by identifier (freed when the scheduler says so); counts runs."""

    def __init__(self, encoder, ec_connector=None):
        self.encoder = encoder
        self.ec = ec_connector  # shared encoder-output store, if any
        self.outputs: dict[str, torch.Tensor] = {}
        self.num_runs = 0  # images actually encoded
        self.num_loads = 0  # images loaded from the shared store

    def load(self, features, hidden: int, dtype: torch.dtype) -> None:
        """Fetch outputs another pod stored; whatever fails to load is encoded instead."""
        todo = [f for f in features if f.identifier not in self.outputs]
        if not todo or self.ec is None:
            return
        loaded = self.ec.start_load_caches(
            [f.identifier for f in todo], [(f.length, hidden) for f in todo], dtype
        )
        for f, out in zip(todo, loaded, strict=True):
            if out is not None:  # kept on the device, as encoded ones are
                self.outputs[f.identifier] = to_device(out, self.encoder.proj.device)
                self.num_loads += 1

    def encode(self, features) -> None:
        todo = [f for f in features if f.identifier not in self.outputs]
        if not todo:
            return
        missing = [f.identifier for f in todo if not f.data]
        if missing:
            raise MissingPixelsError(missing)
        pixels = np.stack(  # one copy out of the read-only buffers
            [np.frombuffer(f.data, dtype=np.dtype(f.dtype)).reshape(f.shape) for f in todo]
        )
        # the tower runs where its weights are
        embeds = self.encoder.encode(to_device(torch.from_numpy(pixels), self.encoder.proj.device))
        for f, out in zip(todo, embeds, strict=True):
            if out.shape[0] != f.length:
                raise ValueError(
                    f"image {f.identifier[:12]}: encoder gave {out.shape[0]} tokens "
                    f"for a {f.length}-token placeholder"
                )
            self.outputs[f.identifier] = out
        self.num_runs += len(todo)
        if self.ec is not None:
            self.ec.save_caches([(f.identifier, self.outputs[f.identifier]) for f in todo])

    def put(self, identifier: str, embeds: torch.Tensor) -> None:
        self.outputs[identifier] = embeds

    def free(self, identifiers: list[str]) -> None:
        for identifier in identifiers:
            self.outputs.pop(identifier, None)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``; to a GPU through pinned memory without waiting (an
    ordinary copy from pageable memory waits for the device's queue to drain)."""
    if device.type != "cuda" or t.device == device:
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def place_image_embeddings(
    embeds: torch.Tensor, order, starts, counts, qsl, features_of, outputs: EncoderOutputs
) -> ImageSpans:
    """Write encoder outputs into ``embeds`` rows; returns the step's bidirectional spans
    (``outputs`` None: the spans only, on a tensor-parallel rank that takes the output rank's
    embeddings). ``starts``, ``counts`` and ``qsl`` are the host-side step inputs: each
    sequence's first position, query count and first flat row."""
    starts, counts, qsl = (x.tolist() if torch.is_tensor(x) else x for x in (starts, counts, qsl))
    triples = []
    for i, req_id in enumerate(order):
        feats = features_of(req_id)
        if not feats:
            continue
        start, n = starts[i], counts[i]
        for f in feats:
            a, b = max(f.offset, start), min(f.end, start + n)
            if a >= b:
                continue
            triples.append((i, f.offset, f.end))
            if outputs is None:
                continue
            out = outputs.outputs.get(f.identifier)
            if out is None:  # not scheduled for encoding (should not happen): encode, don't die
                outputs.encode([f])
                out = outputs.outputs[f.identifier]
            row = qsl[i] + a - start
            embeds[row : row + (b - a)] = out[a - f.offset : b - f.offset].to(embeds.dtype)
    return ImageSpans.build(triples, starts, counts, qsl)
