"""Frontend side of outputs: detokenize, stop strings, logprobs, per-request collectors."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from epdserve.engine.core.interfaces import EngineCoreOutput, Logprobs
from epdserve.engine.outputs.detokenizer import IncrementalDetokenizer
from epdserve.engine.sampling_params import RequestOutputKind, SamplingParams
from epdserve.engine.tokenizer import TokenizerInfo


@dataclass
class SeqDelta:
    """What one of a request's ``n`` sequences produced since the last read."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[tuple[list[int], list[float], int]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class StreamOutput:
    """One read of a request: a delta (DELTA) or everything so far (CUMULATIVE/FINAL_ONLY)."""

    request_id: str
    seqs: list[SeqDelta]
    num_cached_tokens: int
    finished: bool
    prompt_logprobs: list | None = None
    error: str | None = None
    kv_transfer_params: dict | None = None  # for the next pod (P/D), once finished
    ec_transfer_params: dict | None = None  # encoder pods: the items they stored


class _Seq:
    def __init__(self, index: int, detok: IncrementalDetokenizer):
        self.index = index
        self.detok = detok
        self.sent_text = 0
        self.token_ids: list[int] = []
        self.sent_tokens = 0
        self.logprobs: list = []
        self.finish_reason: str | None = None
        self.stop_reason = None


class RequestState:
    """Accumulates one request's outputs; ``get()`` merges whatever arrived since last read."""

    def __init__(
        self,
        request_id: str,
        child_ids: list[str],
        params: SamplingParams,
        tok: TokenizerInfo,
        arrival: float,
        stream_interval: int = 1,
    ):
        self.request_id = request_id
        self.stream_interval = stream_interval  # DELTA: tokens per read after the first
        self.params = params
        self.kind = params.output_kind
        self.seqs = {
            cid: _Seq(
                i,
                IncrementalDetokenizer(
                    tok, params.stop, params.skip_special_tokens, params.include_stop_str_in_output
                ),
            )
            for i, cid in enumerate(child_ids)
        }
        self.num_cached_tokens = 0
        self.prompt_logprobs: list | None = [None] if params.prompt_logprobs is not None else None
        self.error: str | None = None
        self.error_status = 503  # 503: the engine is gone; 500/400: this request failed
        self.error_cause = "engine_dead"  # for the request-errors metric
        self.event = asyncio.Event()
        self.arrival = arrival
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.num_generated = 0
        self.kv_transfer_params: dict | None = None
        self.ec_transfer_params: dict | None = None

    @property
    def finished(self) -> bool:
        return self.error is not None or all(s.finish_reason for s in self.seqs.values())

    def process(self, out: EngineCoreOutput) -> bool:
        """Apply one core output; returns True if a stop string finished the sequence."""
        seq = self.seqs[out.request_id]
        if out.error is not None:
            self.fail(out.error, out.error_status)
            return False
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        if out.kv_transfer_params is not None and seq.index == 0:
            self.kv_transfer_params = out.kv_transfer_params
        if out.ec_transfer_params is not None and seq.index == 0:
            self.ec_transfer_params = out.ec_transfer_params
        if (
            out.new_prompt_logprobs is not None
            and self.prompt_logprobs is not None
            and seq.index == 0
        ):
            self.prompt_logprobs.extend(_unpack(out.new_prompt_logprobs))
        stopped = False
        if seq.finish_reason is None:
            seq.token_ids.extend(out.new_token_ids)
            if out.new_logprobs is not None:
                seq.logprobs.extend(_unpack(out.new_logprobs))
            stop = seq.detok.update(out.new_token_ids)
            if stop is not None and out.finish_reason is None:
                seq.finish_reason, seq.stop_reason, stopped = "stop", stop, True
            elif out.finish_reason is not None:
                seq.finish_reason, seq.stop_reason = out.finish_reason, out.stop_reason
        self.event.set()
        return stopped

    def fail(self, message: str, status: int = 503) -> None:
        if self.error is None:
            self.error, self.error_status = message, status
        self.event.set()

    async def get(self) -> StreamOutput:
        while True:
            await self.event.wait()
            self.event.clear()
            if self.ready():
                return self._snapshot()

    def ready(self) -> bool:
        """Whether a read now returns: FINAL_ONLY at the end; DELTA at the end, for a
        sequence's first token, or once ``stream_interval`` tokens wait; CUMULATIVE always."""
        if self.finished or self.kind == RequestOutputKind.CUMULATIVE:
            return True
        if self.kind == RequestOutputKind.FINAL_ONLY:
            return False
        if self.stream_interval == 1:
            return True
        waiting = [len(s.token_ids) - s.sent_tokens for s in self.seqs.values()]
        firsts = any(s.sent_tokens == 0 and s.token_ids for s in self.seqs.values())
        return firsts or max(waiting) >= self.stream_interval

    def _snapshot(self) -> StreamOutput:
        delta = self.kind == RequestOutputKind.DELTA
        seqs = []
        for seq in sorted(self.seqs.values(), key=lambda s: s.index):
            t0 = seq.sent_text if delta else 0
            k0 = seq.sent_tokens if delta else 0
            seqs.append(
                SeqDelta(
                    seq.index,
                    seq.detok.text[t0:],
                    seq.token_ids[k0:],
                    seq.logprobs[k0:],
                    seq.finish_reason,
                    seq.stop_reason,
                )
            )
            seq.sent_text, seq.sent_tokens = len(seq.detok.text), len(seq.token_ids)
        return StreamOutput(
            self.request_id,
            seqs,
            self.num_cached_tokens,
            self.finished,
            self.prompt_logprobs,
            self.error,
            self.kv_transfer_params if self.finished else None,
            self.ec_transfer_params if self.finished else None,
        )

    def record_tokens(self, n: int, now: float) -> tuple[float | None, float | None]:
        """Returns (ttft, itl) samples for metrics when ``n`` new tokens arrive."""
        if n <= 0:
            return None, None
        self.num_generated += n
        if self.first_token_time is None:
            self.first_token_time = self.last_token_time = now
            return now - self.arrival, None
        itl = now - self.last_token_time
        self.last_token_time = now
        return None, itl


def fan_out(
    request_id: str,
    params: SamplingParams,
    tok: TokenizerInfo,
    arrival: float,
    stream_interval: int = 1,
) -> tuple[RequestState, list[tuple[str, SamplingParams]]]:
    """One request's state and its ``n`` engine sequences: ``(child id, parameters)`` (the
    request id itself when ``n`` is 1; each child of a seeded request gets its own seed)."""
    params = params.with_bad_words_token_ids(tok)  # the sampler masks token ids
    if params.n == 1:
        children = [(request_id, params)]
    else:
        children = [(f"{request_id}-{i}", params.for_child(i)) for i in range(params.n)]
    state = RequestState(
        request_id, [c for c, _ in children], params, tok, arrival, stream_interval
    )
    return state, children


def _unpack(lp: Logprobs) -> list[tuple[list[int], list[float], int]]:
    return list(zip(lp.token_ids, lp.logprobs, lp.ranks, strict=True))
