"""Completions and chat completions on top of ``AsyncLLM`` (vLLM's response shapes)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import msgspec

from epdserve.engine.async_llm import AsyncLLM
from epdserve.engine.entrypoints.openai.errors import APIError, from_value_error
from epdserve.engine.entrypoints.openai.limits import (
    RequestLimits,
    check_count,
    check_sampling_fields,
)
from epdserve.engine.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from epdserve.engine.kv_transfer.params import validate_kv_transfer_params
from epdserve.engine.inputs.processor import check_processor_kwargs
from epdserve.engine.tokenizer import RESERVED_TEMPLATE_KWARGS

_json = msgspec.json.Encoder()


def sse(obj) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


class Prepared:
    """A validated request: prompts as token ids plus sampling parameters."""

    def __init__(self, prompts: list[list[int]], texts: list[str | None], params, kind: str):
        self.prompts, self.texts, self.params, self.kind = prompts, texts, params, kind
        self.kv_transfer_params: dict | None = None
        self.mm_features: list = []  # for the (single) chat prompt
        self.cache_salt: str | None = None  # tenant isolation (vLLM's cache_salt)
        self.echo_text = ""  # chat: the assistant's last message, when it is continued
        self.request_id = new_request_id(kind)
        self.label: str | None = None  # the client's X-Request-Id: logs and the echo only
        self.created = int(time.time())

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
        self, engine: AsyncLLM, served_model_name: str, limits: RequestLimits | None = None
    ):
        self.engine = engine
        self.model_name = served_model_name
        self.tok = engine.tokenizer
        self.limits = limits or RequestLimits()
        self.multimodal = None  # set for image+text models (FrontendMultimodal)
        self.role = "both"

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"The model `{model}` does not exist. Valid models: {self.model_name}.",
                "model",
            )

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
        check_count(req.logprobs, self.limits.max_logprobs, "logprobs")
        raw = req.prompt
        if isinstance(raw, str) or raw and isinstance(raw[0], int):
            raw = [raw]
        if not raw:
            raise APIError(400, "prompt: must not be empty", "prompt")
        if len(raw) > self.limits.max_prompts:
            raise APIError(400, f"prompt: at most {self.limits.max_prompts} prompts", "prompt")
        for item in raw:
            if not isinstance(item, str) and any(t < 0 or t >= self.tok.vocab_size for t in item):
                raise APIError(400, "prompt: token ids must be within the vocabulary", "prompt")
        prompts, texts = await asyncio.to_thread(self._tokenize_prompts, raw)
        return self._finish_prepare(req, prompts, texts, req.max_tokens, req.logprobs, "completion")

    def _tokenize_prompts(self, raw: list) -> tuple[list[list[int]], list[str | None]]:
        prompts, texts = [], []
        for item in raw:
            ids = self.tok.encode(item) if isinstance(item, str) else list(item)
            if not ids:
                raise APIError(400, "prompt: must contain at least one token", "prompt")
            prompts.append(ids)
            texts.append(item if isinstance(item, str) else self.tok.decode(ids, False))
        return prompts, texts

    async def prepare_chat(self, req: ChatCompletionRequest) -> Prepared:
        self.check_model(req.model)
        check_sampling_fields(req, self.limits, self.tok.vocab_size)
        check_count(req.top_logprobs, self.limits.max_logprobs, "top_logprobs")
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs: requires logprobs to be true", "top_logprobs")
        messages, urls = self._chat_messages(req)
        if self.role == "encoder" and not urls:
            raise APIError(
                400, "messages: an encoder pod serves requests with images only", "messages"
            )
        try:
            if req.prompt_token_ids is not None:
                text, ids, features = self._pretokenized(req, urls)
            else:
                images = await asyncio.gather(*(self.multimodal.load_async(u, w) for u, w in urls))
                text, ids, features = await asyncio.to_thread(
                    self._render_chat, req, messages, images
                )
        except ValueError as exc:
            raise from_value_error(exc) from exc
        if not ids:
            raise APIError(400, "messages: the rendered prompt has no tokens", "messages")
        max_tokens = req.max_completion_tokens or req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        prep = self._finish_prepare(req, [ids], [text], max_tokens, logprobs, "chat")
        prep.mm_features = features
        last = messages[-1]
        if req.echo and last["role"] == "assistant" and isinstance(last["content"], str):
            prep.echo_text = last["content"]
        return prep

    def _pretokenized(self, req: ChatCompletionRequest, urls: list) -> tuple[None, list, list]:
        """A chat prompt rendered and tokenized upstream (a router): ids checked only."""
        if urls:
            raise ValueError("prompt_token_ids: not supported for messages with images")
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & (req.chat_template_kwargs or {}).keys())
        if reserved:  # refused as when this pod renders the template itself
            raise ValueError(f"chat_template_kwargs: {', '.join(reserved)} cannot be set")
        if any(t < 0 or t >= self.tok.vocab_size for t in req.prompt_token_ids):
            raise ValueError("prompt_token_ids: token ids must be within the vocabulary")
        return None, list(req.prompt_token_ids), []

    def _render_chat(self, req: ChatCompletionRequest, messages: list[dict], images: list):
        """Chat template, tokens and image features (in a worker thread)."""
        text = self.tok.apply_chat_template(
            messages, req.add_generation_prompt, **(req.chat_template_kwargs or {})
        )
        if req.mm_processor_kwargs is not None and self.multimodal is None:
            raise ValueError("mm_processor_kwargs: this model takes no image inputs")
        if images:
            ids, features = self.multimodal.process(
                text, images, processor_kwargs=req.mm_processor_kwargs
            )
            return text, ids, features
        if req.mm_processor_kwargs is not None:
            check_processor_kwargs(req.mm_processor_kwargs)
        return text, self.tok.encode(text, add_special_tokens=False), []

    def _chat_messages(self, req: ChatCompletionRequest) -> tuple[list[dict], list]:
        """Template-ready messages, and ``(url, part name)`` of their image parts in order."""
        messages, urls = [], []
        for i, message in enumerate(req.messages):
            content = message.content
            if isinstance(content, list):
                parts = []
                for j, part in enumerate(content):
                    where = f"messages[{i}].content[{j}]"
                    if part.type == "text":
                        parts.append({"type": "text", "text": part.text or ""})
                        continue
                    if self.multimodal is None:
                        raise APIError(
                            400, f"{where}: {self.model_name} is not a multimodal model", where
                        )
                    if part.image_url is None:
                        raise APIError(400, f"{where}: an image part needs image_url.url", where)
                    urls.append((part.image_url.url, where))
                    if len(urls) > self.multimodal.max_images:
                        raise APIError(
                            400,
                            f"{where}: at most {self.multimodal.max_images} images per request",
                            where,
                        )
                    parts.append({"type": "image"})
                content = parts if urls else "".join(p.get("text", "") for p in parts)
            messages.append({"role": message.role, "content": content or ""})
        return messages, urls

    def _finish_prepare(self, req, prompts, texts, max_tokens, logprobs, kind) -> Prepared:
        limit = self.engine.max_model_len
        for ids in prompts:
            if len(ids) >= limit:
                raise APIError(
                    400,
                    f"This model's maximum context length is {limit} tokens. "
                    f"However, your prompt contains {len(ids)} input tokens, "
                    f"{len(ids) - limit + 1} too many to generate even one "
                    "token. Please reduce the length of the prompt.",
                    "input_tokens",
                )
        if max_tokens is None:
            max_tokens = 16 if kind == "completion" else limit - max(len(p) for p in prompts)
        longest = max(len(p) for p in prompts)
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
            params = req.sampling_params(max_tokens, logprobs)
            transfer = validate_kv_transfer_params(req.kv_transfer_params)
        except ValueError as exc:
            raise from_value_error(exc) from exc
        prep = Prepared(prompts, texts, params, kind)
        prep.kv_transfer_params = transfer
        prep.cache_salt = req.cache_salt
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
                prep.mm_features,
                prep.cache_salt,
                prep.label,
            ):
                yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, ids: list[int]):
            try:
                async for out in self.engine.generate(
                    ids,
                    prep.params,
                    f"{prep.request_id}-p{i}",
                    prep.kv_transfer_params,
                    cache_salt=prep.cache_salt,
                    label=prep.label,
                ):
                    await queue.put((i, out))
            except Exception as exc:  # surfaced to the consumer below
                await queue.put((i, exc))
            await queue.put((i, None))

        tasks = [asyncio.create_task(pump(i, ids)) for i, ids in enumerate(prep.prompts)]
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
        finally:
            for task in tasks:
                task.cancel()
