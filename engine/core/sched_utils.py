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


def apply_step_output(
    scheduler: Scheduler, result: ModelRunnerOutput, owners: list | None
) -> list[EngineCoreOutput]:
    """``Scheduler.update_from_output``: each request's tokens, the stop check and its
    output; a finished request is freed. This runs for every request of every step, so the
    common case (a request that goes on) is inline: no call but the append."""
    outputs = []
    if scheduler.kv_transfer is not None:
        ready, released = scheduler.kv_transfer.update(result.kv_connector_output)
        scheduler.waiting.put_first(ready)
        outputs.extend(released)
    scheduler.update_failures = failures = []
    faults = injected_fault("update") is not None  # tests only: one env read per step
    get, max_len = scheduler.requests.get, scheduler.max_model_len
    all_logprobs, all_prompt_lps = result.logprobs, result.prompt_logprobs
    for k, (req_id, token_ids) in enumerate(
        zip(result.req_ids, result.sampled_token_ids, strict=True)
    ):
        request = get(req_id)
        if request is None or (owners is not None and owners[k] is not request):
            continue  # aborted (or finished, with steps overlapped) while its step ran
        try:  # one request's failure here is its own (the step guard fails it)
            if faults:
                maybe_fail("update", (req_id,))
            prompt_lp = all_prompt_lps.get(req_id) if all_prompt_lps else None
            logprobs = all_logprobs.get(req_id) if all_logprobs else None
            if not token_ids:  # a prefill chunk: nothing sampled
                if prompt_lp is not None:  # but prompt logprobs to tell
                    output = make_output(request, token_ids, logprobs, prompt_lp)
                    _settled(scheduler, request, output, outputs)
                continue
            if request.num_output_placeholders:  # overlapped: the placeholders are known now
                left = request.num_output_placeholders - len(token_ids)
                request.num_output_placeholders = max(0, left)
            request.append_output_token_ids(token_ids)
            if request.grammar is not None:
                request.grammar.accept(token_ids)
            produced, last = len(request.output_token_ids), token_ids[-1]
            if (  # anything that may end it: check_stop says which
                produced >= request.max_tokens
                or len(request.all_token_ids) >= max_len
                or request.grammar is not None
                or (
                    produced >= request.min_tokens
                    and (last == request.stop_eos or last in request.stop_token_ids)
                )
            ) and check_stop(request, max_len):
                output = make_output(request, token_ids, logprobs, prompt_lp)
                _settled(scheduler, request, output, outputs)
                continue
            cached = request.num_cached_tokens  # make_output's, for a request still running
            outputs.append(
                EngineCoreOutput(
                    req_id, token_ids, logprobs, prompt_lp, None, None, cached if cached > 0 else 0
                )
            )
        except Exception as exc:
            failures.append((req_id, exc))
    return outputs


def _settled(scheduler: Scheduler, request: Request, output: EngineCoreOutput, outputs: list):
    """Tell ``output`` of a request that may have finished: a finished one is freed, and its
    output held back while its blocks wait for the next pod to load them."""
    if request.is_finished:
        if request in scheduler.running:
            scheduler.running.remove(request)
        else:  # overlapped: preempted (a failed schedule undone) while this step ran
            scheduler.waiting.remove(request)
        output.kv_transfer_params, held = scheduler._free(request)
        if held and output.kv_transfer_params is not None:
            scheduler.kv_transfer.hold_output(output)  # sent once the next pod can load it
            return
    outputs.append(output)
