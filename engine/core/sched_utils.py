"""Per-request helpers of the scheduler's update step: stop checks and core outputs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from epdserve.engine.core.interfaces import EngineCoreOutput, Logprobs, ModelRunnerOutput
from epdserve.engine.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from epdserve.engine.core.scheduler import Scheduler


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


def room_after(request: Request, max_model_len: int) -> bool:
    """Whether ``request`` may go on once the tokens of its steps in flight come (overlapped
    scheduling): they neither reach ``max_tokens`` nor ``max_model_len``."""
    pending = request.num_output_placeholders
    return (
        request.num_output_tokens + pending < request.max_tokens
        and request.num_tokens + pending < max_model_len
    )


def update_request(
    scheduler: Scheduler, request: Request, token_ids, result: ModelRunnerOutput
) -> EngineCoreOutput | None:
    """Apply one request's part of a step's output: its tokens, the stop check, and its
    output (None: nothing to tell yet). A finished request is freed."""
    req_id = request.request_id
    prompt_lp = result.prompt_logprobs.get(req_id)
    if not token_ids and prompt_lp is None:
        return None  # a partial prefill chunk
    if token_ids:
        if request.num_output_placeholders:  # overlapped: the placeholders are known now
            request.num_output_placeholders = max(
                0, request.num_output_placeholders - len(token_ids)
            )
        request.append_output_token_ids(token_ids)
        if request.grammar is not None:
            request.grammar.accept(token_ids)
        check_stop(request, scheduler.max_model_len)
    output = make_output(request, token_ids, result.logprobs.get(req_id), prompt_lp)
    held = False
    if request.is_finished:
        if request in scheduler.running:
            scheduler.running.remove(request)
        else:  # overlapped: preempted (a failed schedule undone) while this step ran
            scheduler.waiting.remove(request)
        output.kv_transfer_params, held = scheduler._free(request)
    if held and output.kv_transfer_params is not None:
        scheduler.kv_transfer.hold_output(output)  # sent once the next pod can load it
        return None
    return output
