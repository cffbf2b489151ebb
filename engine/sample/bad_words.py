"""vLLM's ``bad_words``: each word's token sequence may not be generated. The frontend turns
words into token ids (:func:`bad_words_token_ids`); the sampler masks a word's last token
when the output ends with the rest of it (:class:`BadWords`, all rows at once)."""

from __future__ import annotations

import numpy as np

PAD = -2  # a prefix slot a shorter word leaves empty: matches any token
MAX_WORD_TOKENS = 64  # a word's token sequence (the padded arrays are this wide at most)


def bad_words_token_ids(words: list[str], tokenizer) -> list[list[int]]:
    """Each word's token ids as it starts a text and, when that tokenizes differently, after
    a space (vLLM's rule: the spaced form counts when its first token differs and its length
    does not). Ids outside the tokenizer's vocabulary raise ``ValueError``."""
    out: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not plain:
            continue
        out.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    vocab = tokenizer.vocab_size
    if any(t < 0 or t >= vocab for ids in out for t in ids):
        raise ValueError("bad_words: a word tokenizes to ids outside the vocabulary")
    if any(len(ids) > MAX_WORD_TOKENS for ids in out):
        raise ValueError(f"bad_words: a word may be at most {MAX_WORD_TOKENS} tokens")
    return out


class BadWords:
    """Per batch row its words: prefixes right-aligned in ``[rows, words, longest - 1]``
    (``PAD`` where a word is shorter) and last tokens ``[rows, words]``; both grow on a join
    that needs more, never in a step."""

    def __init__(self, num_rows: int):
        self.count = np.zeros(num_rows, dtype=np.int64)
        self._shrink()

    def _shrink(self) -> None:
        """Arrays for no words (when no row holds any: one request's words do not keep them
        wide for every later step)."""
        num_rows = len(self.count)
        self.prefix = np.full((num_rows, 1, 0), PAD, dtype=np.int64)
        self.last = np.zeros((num_rows, 1), dtype=np.int64)

    def set(self, row: int, words: list[list[int]]) -> None:
        words = [w for w in words if w]
        if not words and self.count[row] and self.count.sum() == self.count[row]:
            self.count[row] = 0
            self._shrink()
            return
        n, k = len(words), max((len(w) - 1 for w in words), default=0)
        more_words, longer = n - self.last.shape[1], k - self.prefix.shape[2]
        if more_words > 0 or longer > 0:
            more_words, longer = max(more_words, 0), max(longer, 0)
            pad = ((0, 0), (0, more_words), (longer, 0))
            self.prefix = np.pad(self.prefix, pad, constant_values=PAD)
            self.last = np.pad(self.last, ((0, 0), (0, more_words)))
        self.count[row] = n
        self.prefix[row] = PAD
        width = self.prefix.shape[2]
        for j, w in enumerate(words):
            self.last[row, j] = w[-1]
            if len(w) > 1:
                self.prefix[row, j, width - len(w) + 1 :] = w[:-1]

    def entries(
        self,
        rows: np.ndarray,
        token_ids: np.ndarray,
        num_tokens: np.ndarray,
        num_prompt: np.ndarray,
        vocab: int,
    ):
        """``(i, token)`` to mask (``i``: the index into ``rows``): each word whose prefix
        the row's output ends with (prompt tokens never match)."""
        counts = self.count[rows]
        active = np.flatnonzero(counts)
        if not active.size:
            return None
        r = rows[active]
        words = int(counts[active].max())
        prefix, last = self.prefix[r, :words], self.last[r, :words]
        match = np.arange(words) < counts[active][:, None]
        width = prefix.shape[2]
        if width:
            n = num_tokens[r][:, None]
            pos = n - width + np.arange(width)  # the last `width` positions of each history
            tail = token_ids[r[:, None], np.maximum(pos, 0)]
            tail = np.where(pos >= num_prompt[r][:, None], tail, -1)  # -1: no token
            match &= ((prefix == tail[:, None, :]) | (prefix == PAD)).all(-1)
        match &= last < vocab
        b, w = np.nonzero(match)
        return active[b], last[b, w]
