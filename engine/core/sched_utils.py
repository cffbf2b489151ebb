"""Per-request helpers of the scheduler's update step: stop checks and core outputs."""

from __future__ import annotations

from epdserve.engine.core.interfaces import EngineCoreOutput, Logprobs
from epdserve.engine.core.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> None:
    """Finish ``request`` if its last token is EOS or a stop token, it hit a length cap, or
    its grammar is complete."""
    params = request.params
    last = request.output_token_ids[-1]
    if request.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and last == request.eos_token_id:
            request.status = RequestStatus.FINISHED_STOPPED
            return
        if last in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last
            return
    if request.num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    elif request.grammar is not None and request.grammar.terminated:
        # the grammar took its stop token: nothing more can follow (ignore_eos, min_tokens)
        request.status = RequestStatus.FINISHED_STOPPED


def make_output(
    request: Request,
    token_ids,
    logprobs: Logprobs | None,
    prompt_logprobs: Logprobs | None,
) -> EngineCoreOutput:
    return EngineCoreOutput(
        request.request_id,
        list(token_ids),
        logprobs,
        prompt_logprobs,
        request.status.finish_reason,
        request.stop_reason,
        max(request.num_cached_tokens, 0),
    )
