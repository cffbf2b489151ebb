"""Runner side of multimodal inputs: run the vision encoder, keep its outputs, and place
them at their placeholder positions in a step's input embeddings."""

from __future__ import annotations

import numpy as np
import torch

from epdserve.engine.core.interfaces import MissingPixelsError


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
            if out is not None:
                self.outputs[f.identifier] = out
                self.num_loads += 1

    def encode(self, features) -> None:
        todo = [f for f in features if f.identifier not in self.outputs]
        if not todo:
            return
        missing = [f.identifier for f in todo if not f.data]
        if missing:
            raise MissingPixelsError(missing)
        pixels = torch.stack(
            [
                torch.from_numpy(
                    np.frombuffer(f.data, dtype=np.dtype(f.dtype)).reshape(f.shape).copy()
                )
                for f in todo
            ]
        )
        embeds = self.encoder.encode(pixels.to(self.encoder.proj.device))  # the weights' device
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


def place_image_embeddings(
    embeds: torch.Tensor, order, starts, counts, qsl, features_of, outputs: EncoderOutputs
):
    """Write encoder outputs into ``embeds`` rows; returns the bidirectional spans (``outputs``
    None: the spans only, on a tensor-parallel rank that takes the output rank's embeddings)."""
    spans = []
    for i, req_id in enumerate(order):
        feats = features_of(req_id)
        if not feats:
            continue
        start, n = int(starts[i]), int(counts[i])
        for f in feats:
            a, b = max(f.offset, start), min(f.end, start + n)
            if a >= b:
                continue
            spans.append((i, f.offset, f.end))
            if outputs is None:
                continue
            out = outputs.outputs.get(f.identifier)
            if out is None:  # not scheduled for encoding (should not happen): encode, don't die
                outputs.encode([f])
                out = outputs.outputs[f.identifier]
            row = int(qsl[i]) + a - start
            embeds[row : row + (b - a)] = out[a - f.offset : b - f.offset].to(embeds.dtype)
    return tuple(spans)
