"""Per-request helpers of the scheduler's update step: stop checks and core outputs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from epdserve.engine.core.interfaces import EngineCoreOutput, Logprobs, ModelRunnerOutput
from epdserve.engine.core.request import FINISH_REASONS, Request, RequestStatus
from epdserve.engine.core.step_guard import injected_fault, maybe_fail

if TYPE_CHECKING:
    from epdserve.engine.core.scheduler import Scheduler


def check_stop(request: Request, max_model_len: int) -> bool:
    """Finish ``request`` if its last token is EOS or a stop token, it hit a length cap, or
    its grammar is complete; whether it finished."""
    produced = len(request.output_token_ids)
    if produced >= request.min_tokens:
        last = request.output_token_ids[-1]
        if last == request.stop_eos:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if request.stop_token_ids and last in request.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last
            return True
    if produced >= request.max_tokens or len(request.all_token_ids) >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    if request.grammar is not None and request.grammar.terminated:
        # the grammar took its stop token: nothing more can follow (ignore_eos, min_tokens)
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    return False


def make_output(
    request: Request,
    token_ids: list[int],
    logprobs: Logprobs | None,
    prompt_logprobs: Logprobs | None,
) -> EngineCoreOutput:
    """``token_ids`` is the output's own list (the step's, not kept by anything else)."""
    return EngineCoreOutput(
        request.request_id,
        token_ids,
        logprobs,
        prompt_logprobs,
        FINISH_REASONS[request.status],
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
    scheduler: Scheduler, request: Request, token_ids: list[int], result: ModelRunnerOutput
) -> EngineCoreOutput | None:
    """Apply one request's part of a step's output: its tokens, the stop check, and its
    output (None: nothing to tell yet). A finished request is freed. This runs for every
    request every step: the common case (it goes on) makes no call but the append."""
    req_id = request.request_id
    prompt_lp = result.prompt_logprobs.get(req_id) if result.prompt_logprobs else None
    logprobs = result.logprobs.get(req_id) if result.logprobs else None
    if not token_ids:
        if prompt_lp is None:
            return None  # a partial prefill chunk
        output = make_output(request, token_ids, logprobs, prompt_lp)
        return _finished(scheduler, request, output) if request.is_finished else output
    if request.num_output_placeholders:  # overlapped: the placeholders are known now
        request.num_output_placeholders = max(0, request.num_output_placeholders - len(token_ids))
    request.append_output_token_ids(token_ids)
    if request.grammar is not None:
        request.grammar.accept(token_ids)
    produced, last = len(request.output_token_ids), token_ids[-1]
    if (  # anything that may end it: check_stop says which
        produced >= request.max_tokens
        or len(request.all_token_ids) >= scheduler.max_model_len
        or request.grammar is not None
        or (
            produced >= request.min_tokens
            and (last == request.stop_eos or last in request.stop_token_ids)
        )
    ) and check_stop(request, scheduler.max_model_len):
        return _finished(scheduler, request, make_output(request, token_ids, logprobs, prompt_lp))
    cached = request.num_cached_tokens  # make_output's, for a request still running
    return EngineCoreOutput(req_id, token_ids, logprobs, prompt_lp, None, None, max(cached, 0))


def _finished(scheduler: Scheduler, request: Request, output: EngineCoreOutput):
    """Free a request that just finished; its output, or None while its blocks are held for
    the next pod (sent once it can load them)."""
    if request in scheduler.running:
        scheduler.running.remove(request)
    else:  # overlapped: preempted (a failed schedule undone) while this step ran
        scheduler.waiting.remove(request)
    output.kv_transfer_params, held = scheduler._free(request)
    if held and output.kv_transfer_params is not None:
        scheduler.kv_transfer.hold_output(output)
        return None
    return output


def apply_step_output(
    scheduler: Scheduler, result: ModelRunnerOutput, owners: list | None
) -> list[EngineCoreOutput]:
    """``Scheduler.update_from_output``: each request's tokens, stops and output."""
    outputs = []
    if scheduler.kv_transfer is not None:
        ready, released = scheduler.kv_transfer.update(result.kv_connector_output)
        scheduler.waiting.put_first(ready)
        outputs.extend(released)
    scheduler.update_failures = failures = []
    faults = injected_fault("update") is not None  # tests only: one env read per step
    get = scheduler.requests.get
    for k, (req_id, token_ids) in enumerate(
        zip(result.req_ids, result.sampled_token_ids, strict=True)
    ):
        request = get(req_id)
        if request is None or (owners is not None and owners[k] is not request):
            continue  # aborted (or finished, with steps overlapped) while its step ran
        try:  # one request's failure here is its own (the step guard fails it)
            if faults:
                maybe_fail("update", (req_id,))
            output = update_request(scheduler, request, token_ids, result)
        except Exception as exc:
            failures.append((req_id, exc))
            continue
        if output is not None:
            outputs.append(output)
    return outputs
