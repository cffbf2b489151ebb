"""Incremental detokenization and stop strings, per sequence."""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from epdserve.engine.tokenizer import TokenizerInfo


class IncrementalDetokenizer:
    """Feeds tokens one by one; finds stop strings in the text produced so far."""

    def __init__(
        self,
        tok: TokenizerInfo,
        stop: list[str],
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
    ):
        self.tok = tok
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.text = ""
        self.max_stop_len = max((len(s) for s in stop), default=0)

    def update(self, token_ids: list[int]) -> str | None:
        """Append tokens' text; returns the stop string matched (text truncated), else None."""
        for token_id in token_ids:
            start = len(self.text)
            piece = self.stream.step(self.tok.tokenizer, token_id)
            if piece:
                self.text += piece
            if self.stop:
                hit = self._find_stop(start)
                if hit is not None:
                    return hit
        return None

    def _find_stop(self, new_from: int) -> str | None:
        window_start = max(0, new_from - self.max_stop_len + 1)
        for stop in self.stop:
            idx = self.text.find(stop, window_start)
            if idx != -1:
                end = idx + len(stop) if self.include_stop else idx
                self.text = self.text[:end]
                return stop
        return None
