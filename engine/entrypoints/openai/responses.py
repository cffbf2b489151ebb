"""Building OpenAI response bodies and stream chunks from ``StreamOutput`` deltas."""

from __future__ import annotations

from collections.abc import AsyncIterator

from epdserve.engine.entrypoints.openai.serving import OpenAIServing, Prepared, sse
from epdserve.engine.entrypoints.openai.tool_calls import ChoiceTools, choice_tools


class Accumulator:
    """Per choice: text, token count, logprobs and finish state across deltas."""

    def __init__(self, num_choices: int):
        self.text = [""] * num_choices
        self.tokens = [0] * num_choices
        self.logprobs: list[list] = [[] for _ in range(num_choices)]
        self.finish = [None] * num_choices
        self.stop_reason = [None] * num_choices
        self.cached = 0


def completion_logprobs(serving: OpenAIServing, entries: list, offset: int) -> dict:
    tok = serving.tok
    tokens, token_lps, tops, offsets = [], [], [], []
    for ids, lps, _rank in entries:
        text = tok.id_to_token_text(ids[0])
        tokens.append(text)
        token_lps.append(lps[0])
        tops.append({tok.id_to_token_text(t): v for t, v in zip(ids[1:], lps[1:], strict=True)})
        offsets.append(offset)
        offset += len(text)
    return {
        "text_offset": offsets,
        "token_logprobs": token_lps,
        "tokens": tokens,
        "top_logprobs": tops,
    }


def chat_logprobs(serving: OpenAIServing, entries: list) -> dict:
    tok = serving.tok

    def item(token_id: int, value: float) -> dict:
        text = tok.id_to_token_text(token_id)
        return {"token": text, "logprob": value, "bytes": list(text.encode())}

    content = []
    for ids, lps, _rank in entries:
        entry = item(ids[0], lps[0])
        entry["top_logprobs"] = [item(t, v) for t, v in zip(ids[1:], lps[1:], strict=True)]
        content.append(entry)
    return {"content": content}


def echoed(serving: OpenAIServing, prep: Prepared, prompt_index: int, echo: bool) -> str:
    """What ``echo`` puts before the generated text: the prompt (completions), or the last
    message when it is the assistant's own, being continued (chat, as vLLM)."""
    if not echo:
        return ""
    if prep.kind == "chat":
        return prep.echo_text
    return serving.inputs.prompt_text(prep.prompts[prompt_index])


def usage(prep: Prepared, acc: Accumulator) -> dict:
    prompt = sum(len(p.token_ids) for p in prep.prompts)
    completion = sum(acc.tokens)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": acc.cached},
    }


async def full_response(serving: OpenAIServing, prep: Prepared, echo: bool) -> dict:
    n = prep.params.n
    acc = Accumulator(n * len(prep.prompts))
    kv_transfer_params = ec_transfer_params = None
    async for i, out in serving.events(prep):
        acc.cached += out.num_cached_tokens if out.finished else 0
        if i == 0 and out.kv_transfer_params is not None:
            kv_transfer_params = out.kv_transfer_params
        if i == 0 and out.ec_transfer_params is not None:
            ec_transfer_params = out.ec_transfer_params
        for seq in out.seqs:
            c = i * n + seq.index
            acc.text[c] += seq.text
            acc.tokens[c] += len(seq.token_ids)
            acc.logprobs[c].extend(seq.logprobs)
            if seq.finish_reason:
                acc.finish[c], acc.stop_reason[c] = seq.finish_reason, seq.stop_reason
    chat = prep.kind == "chat"
    tools = choice_tools(serving, prep, len(acc.text))
    choices = []
    for c in range(len(acc.text)):
        prefix = echoed(serving, prep, c // n, echo)
        choice = {
            "index": c,
            "finish_reason": acc.finish[c],
            "stop_reason": acc.stop_reason[c],
            "logprobs": None,
        }
        if prep.params.logprobs is not None:
            choice["logprobs"] = (
                chat_logprobs(serving, acc.logprobs[c])
                if chat
                else completion_logprobs(serving, acc.logprobs[c], len(prefix))
            )
        if chat:
            choice["message"] = {"role": "assistant", "content": prefix + acc.text[c]}
            if tools is not None:
                choice["finish_reason"] = tool_message(
                    choice["message"], tools[c], prefix, acc.text[c], acc.finish[c]
                )
        else:
            choice["text"] = prefix + acc.text[c]
        choices.append(choice)
    return {
        "id": prep.request_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": prep.created,
        "model": prep.model_name or serving.model_name,
        "choices": choices,
        "usage": usage(prep, acc),
        "kv_transfer_params": kv_transfer_params,
        "ec_transfer_params": ec_transfer_params,
        **(
            {"processed_prompt": serving.inputs.to_wire(prep.prompts[0], prep.cache_salt)}
            if prep.return_prompt
            else {}
        ),
    }


def tool_message(
    message: dict, tools: ChoiceTools, prefix: str, text: str, finish: str | None
) -> str | None:
    """Puts a choice's content and tool calls into ``message``; returns its finish_reason."""
    fields, finish = tools.message(text, finish)
    content = fields["content"]
    # an echoed prefix leads the content (vLLM); no content and no prefix stays null
    fields["content"] = prefix + content if content is not None else prefix or None
    message.update(fields)
    return finish


async def stream_response(
    serving: OpenAIServing,
    prep: Prepared,
    echo: bool,
    include_usage: bool,
    continuous_usage: bool = False,
) -> AsyncIterator[bytes]:
    """SSE chunks; ``continuous_usage`` (vLLM's ``continuous_usage_stats``) puts the usage
    so far on every chunk too."""
    chat = prep.kind == "chat"
    n = prep.params.n
    acc = Accumulator(n * len(prep.prompts))
    head = {
        "id": prep.request_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": prep.created,
        "model": prep.model_name or serving.model_name,
    }
    if chat:
        for c in range(len(acc.text)):
            yield sse(
                {
                    **head,
                    "choices": [
                        {
                            "index": c,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                }
            )
    tools = choice_tools(serving, prep, len(acc.text))
    started = [False] * len(acc.text)
    async for i, out in serving.events(prep):
        if out.finished:
            acc.cached += out.num_cached_tokens
        for seq in out.seqs:
            c = i * n + seq.index
            if not seq.text and not seq.token_ids and not seq.finish_reason:
                continue
            prefix = "" if started[c] else echoed(serving, prep, i, echo)
            text = prefix + seq.text
            started[c] = True
            acc.tokens[c] += len(seq.token_ids)
            choice = {
                "index": c,
                "logprobs": None,
                "finish_reason": seq.finish_reason,
                "stop_reason": seq.stop_reason,
            }
            if prep.params.logprobs is not None and seq.logprobs:
                choice["logprobs"] = (
                    chat_logprobs(serving, seq.logprobs)
                    if chat
                    else completion_logprobs(serving, seq.logprobs, len(acc.text[c]))
                )
            acc.text[c] += text
            if tools is not None:
                delta = tools[c].delta(seq.text, seq.finish_reason is not None, prefix)
                choice["finish_reason"] = tools[c].finish_reason(seq.finish_reason)
                if delta is None and not seq.finish_reason and choice["logprobs"] is None:
                    continue  # held back: maybe the start of a call
                choice["delta"] = delta or {}
            elif chat:
                choice["delta"] = {"content": text}
            else:
                choice["text"] = text
            chunk = {**head, "choices": [choice]}
            if continuous_usage:
                chunk["usage"] = usage(prep, acc)
            yield sse(chunk)
    if include_usage:
        yield sse({**head, "choices": [], "usage": usage(prep, acc)})
    yield b"data: [DONE]\n\n"
