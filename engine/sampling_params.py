"""Sampling parameters of one request, validated at the edge (vLLM's semantics)."""

from __future__ import annotations

import enum

import msgspec

from epdserve.engine.sample.bad_words import bad_words_token_ids
from epdserve.engine.structured.params import StructuredOutputsParams

_SAMPLING_EPS = 1e-5
# bad_words bounds: the sampler keeps each row's words as padded arrays, so one request's
# words must not size them without limit
MAX_BAD_WORDS = 128
MAX_BAD_WORD_CHARS = 256


class RequestOutputKind(enum.IntEnum):
    CUMULATIVE = 0  # every output carries everything generated so far
    DELTA = 1  # only what is new since the last output
    FINAL_ONLY = 2  # one output, when the request finishes


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """How to sample; invalid values raise ``ValueError`` naming the field."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    logit_bias: dict[int, float] | None = None  # added to the logits before sampling
    structured_outputs: StructuredOutputsParams | None = None  # the output's grammar
    bad_words: list[str] = []  # words the output may not contain (vLLM's)
    # their token sequences, filled by the frontend's tokenizer (the sampler reads these)
    bad_words_token_ids: list[list[int]] = []

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        _check(isinstance(self.n, int) and self.n >= 1, "n", f"must be at least 1, got {self.n}")
        _check(
            self.temperature >= 0.0, "temperature", f"must be non-negative, got {self.temperature}"
        )
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, "top_k", f"must be -1 (disable) or at least 1, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(
            self.max_tokens is None or self.max_tokens >= 1,
            "max_tokens",
            f"must be at least 1, got {self.max_tokens}",
        )
        _check(self.min_tokens >= 0, "min_tokens", f"must be non-negative, got {self.min_tokens}")
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"must be at most max_tokens={self.max_tokens}, got {self.min_tokens}",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2.0 <= value <= 2.0, name, f"must be in [-2, 2], got {value}")
        _check(
            self.repetition_penalty > 0.0,
            "repetition_penalty",
            f"must be greater than zero, got {self.repetition_penalty}",
        )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or value >= 0, name, f"must be non-negative, got {value}")
        _check(all(s for s in self.stop), "stop", "must not contain empty strings")
        _check(
            all(
                isinstance(t, int) and t >= 0 and -100.0 <= v <= 100.0
                for t, v in (self.logit_bias or {}).items()
            ),
            "logit_bias",
            "keys must be token ids and values in [-100, 100]",
        )
        _check(
            all(isinstance(w, str) and w.strip() for w in self.bad_words),
            "bad_words",
            "must be non-empty strings",
        )
        _check(
            len(self.bad_words) <= MAX_BAD_WORDS
            and all(len(w) <= MAX_BAD_WORD_CHARS for w in self.bad_words),
            "bad_words",
            f"at most {MAX_BAD_WORDS} words of at most {MAX_BAD_WORD_CHARS} characters each",
        )
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "must be non-negative token ids",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    @property
    def needs_penalties(self) -> bool:
        return (
            abs(self.presence_penalty) > _SAMPLING_EPS
            or abs(self.frequency_penalty) > _SAMPLING_EPS
            or abs(self.repetition_penalty - 1.0) > _SAMPLING_EPS
        )

    def with_bad_words_token_ids(self, tokenizer) -> SamplingParams:
        """These parameters with ``bad_words`` tokenized (the frontend, once per request)."""
        if not self.bad_words or self.bad_words_token_ids:
            return self
        ids = bad_words_token_ids(self.bad_words, tokenizer)
        return msgspec.structs.replace(self, bad_words_token_ids=ids)

    def for_child(self, index: int) -> SamplingParams:
        """Parameters of the ``index``-th of ``n`` parallel samples (own seed, n=1)."""
        seed = None if self.seed is None else self.seed + index
        return msgspec.structs.replace(self, n=1, seed=seed)


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{field}: {message}")
