"""Completions and chat completions on top of ``AsyncLLM`` (vLLM's response shapes)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import msgspec

from epdserve.common.chat_template import render_options
from epdserve.engine.async_llm import AsyncLLM
from epdserve.engine.entrypoints.openai.errors import APIError, from_value_error
from epdserve.engine.entrypoints.openai.limits import (
    RequestLimits,
    check_count,
    check_priority,
    check_sampling_fields,
)
from epdserve.engine.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from epdserve.engine.entrypoints.openai.structured_request import (
    check_tool_parameters,
    structured_outputs_of,
    wants_structured_outputs,
)
from epdserve.engine.entrypoints.openai.tool_request import ToolRequest, check_tools, forced_schema
from epdserve.engine.inputs.processor import InputProcessor
from epdserve.engine.inputs.prompt import ProcessedPrompt
from epdserve.engine.kv_transfer.params import validate_kv_transfer_params
from epdserve.engine.lora.registry import LoRARegistry
from epdserve.engine.lora.request import LoRARequest

_json = msgspec.json.Encoder()


def sse(obj) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


class Prepared:
    """A validated request: processed prompts plus sampling parameters."""

    def __init__(self, prompts: list[ProcessedPrompt], params, kind: str):
        self.prompts, self.params, self.kind = prompts, params, kind
        self.kv_transfer_params: dict | None = None
        self.cache_salt: str | None = None  # tenant isolation (vLLM's cache_salt)
        self.priority = 0  # lower is served earlier (--scheduling-policy priority)
        self.echo_text = ""  # chat: the assistant's last message, when it is continued
        self.request_id = new_request_id(kind)
        self.label: str | None = None  # the client's X-Request-Id: logs and the echo only
        self.client: str | None = None  # its peer's address: grammar compiles take turns by it
        self.created = int(time.time())
        # the answer carries the processed prompt, for the next pod of a disaggregated pool
        self.return_prompt = False
        self.lora_request: LoRARequest | None = None  # the adapter its ``model`` names
        self.model_name = ""  # the ``model`` its answer names (the adapter's or the base's)
        # chat: the tools as given, the choice in force ("auto" when tools come without
        # one) and whether several calls may be made: the output side's to read
        self.tools: list[dict] | None = None
        self.tool_choice: str | dict | None = None
        self.parallel_tool_calls = True

    @property
    def num_seqs(self) -> int:
        """Sequences this request puts in the engine (n per prompt)."""
        return len(self.prompts) * self.params.n


def new_request_id(kind: str) -> str:
    """``cmpl-…``/``chatcmpl-…``: always the server's own and unique (128 random bits),
    never derived from the client's X-Request-Id, which is only a label."""
    return f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{uuid.uuid4().hex}"


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncLLM,
        served_model_name: str,
        inputs: InputProcessor,
        limits: RequestLimits | None = None,
        role: str = "both",
    ):
        self.engine = engine
        self.model_name = served_model_name
        self.inputs = inputs
        self.tok = inputs.tok
        self.limits = limits or RequestLimits()
        self.role = role
        self.loras: LoRARegistry | None = None  # the adapters served, when LoRA is on

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The adapter ``model`` names (None: the base model); 404 for an unknown name."""
        if model is None or model == self.model_name:
            return None
        lora = self.loras.get(model) if self.loras is not None else None
        if lora is None:
            valid = ", ".join([self.model_name, *(self.loras.adapters if self.loras else ())])
            raise APIError(
                404, f"The model `{model}` does not exist. Valid models: {valid}.", "model"
            )
        return lora

    # --- preparation: cheap checks here, tokenizing/templating/images off the loop -----
    async def prepare_completion(self, req: CompletionRequest) -> Prepared:
        self.check_model(req.model)
        if self.role == "encoder":
            raise APIError(
                400, "prompt: an encoder pod serves chat requests with images only", "prompt"
            )
        if req.suffix is not None:
            raise APIError(400, "suffix: not supported", "suffix")
        check_sampling_fields(req, self.limits, self.tok.vocab_size)
        check_priority(req.priority, self.engine.config.scheduling_policy)
        check_count(req.logprobs, self.limits.max_logprobs, "logprobs")
        constraint = await self._structured_outputs(req)
        try:
            if req.processed_prompt is not None:
                prompts = [self.inputs.accept(req.processed_prompt, req.cache_salt)]
            else:
                prompts = await asyncio.to_thread(
                    self._completion_prompts, req.prompt, req.add_special_tokens
                )
        except ValueError as exc:
            raise from_value_error(exc) from exc
        prep = self._finish_prepare(req, prompts, req.max_tokens, req.logprobs, "completion")
        prep.params.structured_outputs = constraint
        return prep

    def _completion_prompts(self, raw, add_special_tokens: bool) -> list[ProcessedPrompt]:
        if isinstance(raw, str) or raw and isinstance(raw[0], int):
            raw = [raw]
        if not raw:
            raise ValueError("prompt: must not be empty")
        if len(raw) > self.limits.max_prompts:
            raise ValueError(f"prompt: at most {self.limits.max_prompts} prompts")
        return [self.inputs.completion(item, add_special_tokens) for item in raw]

    async def prepare_chat(self, req: ChatCompletionRequest) -> Prepared:
        self.check_model(req.model)
        check_sampling_fields(req, self.limits, self.tok.vocab_size)
        check_priority(req.priority, self.engine.config.scheduling_policy)
        check_count(req.top_logprobs, self.limits.max_logprobs, "top_logprobs")
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs: requires logprobs to be true", "top_logprobs")
        tools = check_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
        constraint = await self._structured_outputs(req, tools)
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        try:
            options = render_options(req)  # checks chat_template_kwargs in both cases
            if req.processed_prompt is not None:
                prompt = self.inputs.accept(req.processed_prompt, req.cache_salt)
            else:
                if self.role == "encoder" and not self.inputs.check_chat_images(messages):
                    raise ValueError("messages: an encoder pod serves requests with images only")
                prompt = await self.inputs.chat(
                    messages, options, req.mm_processor_kwargs, req.add_special_tokens
                )
                prompt.salt_items(req.cache_salt)  # a tenant's images share with no other
                # pixels of the images the core does not hold: decoded now, so a bad image
                # is this request's 400 (an image evicted before the send is made then)
                missing = self.engine.pixels.missing(prompt.items)
                if missing:
                    await asyncio.to_thread(lambda: [i.pixels() for i in missing])
        except ValueError as exc:
            raise from_value_error(exc) from exc
        if self.role == "encoder" and not prompt.items:
            raise APIError(
                400, "messages: an encoder pod serves requests with images only", "messages"
            )
        max_tokens = req.max_completion_tokens or req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        prep = self._finish_prepare(req, [prompt], max_tokens, logprobs, "chat")
        prep.params.structured_outputs = constraint
        prep.tools, prep.tool_choice = tools.tools, tools.tool_choice
        prep.parallel_tool_calls = tools.parallel_tool_calls
        last = messages[-1]
        if req.echo and last["role"] == "assistant" and isinstance(last.get("content"), str):
            prep.echo_text = last["content"]
        return prep

    async def _structured_outputs(self, req, tools: ToolRequest | None = None):
        """The output's constraint (its grammar built off the loop) or None; 400s name
        the field (entrypoints/openai/structured_request.py)."""
        forced = tools is not None and tools.forced
        if not forced and not wants_structured_outputs(req):
            return None

        def build():
            if forced:
                check_tool_parameters(tools)
            return structured_outputs_of(req, forced_schema(tools) if forced else None)

        return await asyncio.to_thread(build)

    def _finish_prepare(self, req, prompts, max_tokens, logprobs, kind) -> Prepared:
        limit = self.engine.max_model_len
        for ids in (p.token_ids for p in prompts):
            if len(ids) >= limit:
                raise APIError(
                    400,
                    f"This model's maximum context length is {limit} tokens. "
                    f"However, your prompt contains {len(ids)} input tokens, "
                    f"{len(ids) - limit + 1} too many to generate even one "
                    "token. Please reduce the length of the prompt.",
                    "input_tokens",
                )
        longest = max(len(p.token_ids) for p in prompts)
        if max_tokens is None:
            max_tokens = 16 if kind == "completion" else limit - longest
        if max_tokens >= 1 and longest + max_tokens > limit:
            over = longest + max_tokens - limit
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, "
                f"you requested {longest + max_tokens} tokens ({longest} in the "
                f"prompt, {max_tokens} in the completion), {over} too many. "
                "Please reduce max_tokens or the prompt.",
                "max_tokens",
            )
        try:
            # bad_words tokenized here, where a word's refusal is the client's 400
            params = req.sampling_params(max_tokens, logprobs).with_bad_words_token_ids(self.tok)
            transfer = validate_kv_transfer_params(req.kv_transfer_params)
        except ValueError as exc:
            raise from_value_error(exc) from exc
        prep = Prepared(prompts, params, kind)
        prep.lora_request = self.check_model(req.model)
        prep.model_name = req.model if prep.lora_request is not None else self.model_name
        prep.kv_transfer_params = transfer
        prep.cache_salt = req.cache_salt
        prep.priority = req.priority
        prep.return_prompt = self.role == "encoder" or bool(
            transfer and transfer.get("do_remote_decode")
        )
        return prep

    # --- execution ---------------------------------------------------------------------
    async def events(self, prep: Prepared) -> AsyncIterator[tuple[int, object]]:
        """Merge the per-prompt output streams: yields ``(prompt_index, StreamOutput)``."""
        if len(prep.prompts) == 1:
            async for out in self.engine.generate(
                prep.prompts[0],
                prep.params,
                prep.request_id,
                prep.kv_transfer_params,
                prep.cache_salt,
                prep.label,
                lora_request=prep.lora_request,
                priority=prep.priority,
                client=prep.client,
            ):
                yield 0, out
            self._count_adapter(prep)
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, prompt: ProcessedPrompt):
            try:
                async for out in self.engine.generate(
                    prompt,
                    prep.params,
                    f"{prep.request_id}-p{i}",
                    prep.kv_transfer_params,
                    cache_salt=prep.cache_salt,
                    label=prep.label,
                    lora_request=prep.lora_request,
                    priority=prep.priority,
                    client=prep.client,
                ):
                    await queue.put((i, out))
            except Exception as exc:  # surfaced to the consumer below
                await queue.put((i, exc))
            await queue.put((i, None))

        tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(prep.prompts)]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield i, item
            self._count_adapter(prep)
        finally:
            for task in tasks:
                task.cancel()

    def _count_adapter(self, prep: Prepared) -> None:
        metrics = self.engine.metrics
        if prep.lora_request is not None and metrics is not None and metrics.lora is not None:
            metrics.lora.on_finished(prep.lora_request.lora_name)
