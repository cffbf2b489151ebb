"""What ``LLM.generate`` returns: one ``RequestOutput`` per prompt (vLLM's shape)."""

from __future__ import annotations

from dataclasses import dataclass, field

# One position's logprobs: token id -> Logprob
LogprobsDict = dict[int, "Logprob"]


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[LogprobsDict] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    prompt_logprobs: list[LogprobsDict | None] | None = None
    metrics: dict = field(default_factory=dict)
