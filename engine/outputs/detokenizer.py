"""Incremental detokenization and stop strings, per sequence."""

from __future__ import annotations

import logging

from tokenizers.decoders import DecodeStream

from epdserve.engine.tokenizer import TokenizerInfo

log = logging.getLogger("epdserve.frontend")


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
        self.skip_special_tokens = skip_special_tokens
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.num_resets = 0
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.text = ""
        self.max_stop_len = max((len(s) for s in stop), default=0)

    def update(self, token_ids: list[int]) -> str | None:
        """Append tokens' text; returns the stop string matched (text truncated), else None."""
        for token_id in token_ids:
            start = len(self.text)
            piece = self._step(token_id)
            if piece:
                self.text += piece
            if self.stop:
                hit = self._find_stop(start)
                if hit is not None:
                    return hit
        return None

    def _step(self, token_id: int) -> str | None:
        """One token's new text. A stream whose prefix the tokenizer rejects (e.g. bytes
        that cannot continue the pending ones) starts over from this token, as if the text
        so far were complete; a token it still cannot decode adds no text."""
        try:
            return self.stream.step(self.tok.tokenizer, token_id)
        except Exception as exc:  # the tokenizers binding raises a bare Exception here
            log.warning("detokenizer reset at token %d: %s", token_id, exc)
            self.num_resets += 1
            self.stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
        try:
            return self.stream.step(self.tok.tokenizer, token_id)
        except Exception:
            self.stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
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
