"""Offline inference: ``LLM(model=...).generate(prompts, SamplingParams(...))``.

The same input processor, ``n`` fan-out and output processing as the server; the engine
core runs in this process."""

from __future__ import annotations

import itertools
import time

import msgspec

from epdserve.common.chat_parts import image_parts
from epdserve.engine.config import EngineConfig
from epdserve.engine.core.engine_core import EngineCore, EngineCoreRequest
from epdserve.engine.core.interfaces import MMFeature
from epdserve.engine.inputs.images import LoadedImage, load_image_url
from epdserve.engine.inputs.processor import InputProcessor
from epdserve.engine.inputs.prompt import ProcessedPrompt
from epdserve.engine.lora.digest import adapter_digest
from epdserve.engine.lora.peft_files import inspect_adapter
from epdserve.engine.lora.registry import LoRARegistry
from epdserve.engine.lora.request import LoRARequest
from epdserve.engine.outputs.output_processor import RequestState, fan_out
from epdserve.engine.outputs.request_output import CompletionOutput, Logprob, RequestOutput
from epdserve.engine.sampling_params import SamplingParams
from epdserve.engine.structured.backend import validate as validate_structured


class LLM:
    """A whole engine in this process; ``generate`` runs requests to completion."""

    def __init__(self, model: str, **kwargs):
        self.config = EngineConfig(model=str(model), **kwargs)
        self.engine = EngineCore(self.config)
        self.inputs = InputProcessor(
            self.config.model,
            self.config.model,
            processor_kwargs=self.config.mm_processor_kwargs,
        )
        self.tokenizer = self.inputs.tok
        self._ids = itertools.count()
        self.loras = None  # the --lora-modules adapters, by name
        if self.config.enable_lora:
            self.loras = LoRARegistry(self.config.model, self.config.max_lora_rank, str(model))
            self.loras.add_modules(self.config.lora_modules)
        self._checked_loras: dict[tuple[int, str], str] = {}  # -> the files' digest

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora_request=None,
        priority: int | list[int] | None = None,
    ) -> list[RequestOutput]:
        """``lora_request``: a ``LoRARequest`` (or a ``--lora-modules`` name) for every
        prompt, or a list of them (None entries: the base model). ``priority``: one for
        every prompt or a list (lower first; other than 0 only with
        ``scheduling_policy="priority"``)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = sampling_params if sampling_params is not None else SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("sampling_params: the list must have one entry per prompt")
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError("lora_request: the list must have one entry per prompt")
        loras = [self._lora(x) for x in loras]
        priorities = self._priorities(priority, len(prompts))
        states = [
            self._add(*args) for args in zip(prompts, params_list, loras, priorities, strict=True)
        ]
        by_child = {cid: state for state, _ in states for cid in state.seqs}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                state = by_child[out.request_id]
                if state.process(out):  # a stop string ended it
                    self.engine.abort_requests([out.request_id])
        return [self._result(state, prompt) for state, prompt in states]

    def chat(
        self,
        messages: list[dict],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = False,
        mm_processor_kwargs: dict | None = None,
        lora_request=None,
    ) -> list[RequestOutput]:
        """One conversation (or a list of them) of OpenAI-style messages; images allowed.
        ``mm_processor_kwargs`` overrides the engine's image-processor options."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [self._chat_prompt(c, mm_processor_kwargs) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def _priorities(self, priority, n: int) -> list[int]:
        """One checked priority per prompt (``ValueError`` naming the field)."""
        values = priority if isinstance(priority, list) else [priority or 0] * n
        if len(values) != n:
            raise ValueError("priority: the list must have one entry per prompt")
        for p in values:
            if isinstance(p, bool) or not isinstance(p, int) or not -(1 << 63) <= p < 1 << 63:
                raise ValueError(f"priority: must be a 64-bit signed integer, got {p!r}")
            if p and self.config.scheduling_policy != "priority":
                raise ValueError(f"priority: {p} needs scheduling_policy='priority' (this is fcfs)")
        return values

    def _lora(self, lora: LoRARequest | str | None) -> LoRARequest | None:
        """An adapter checked against the model once (``ValueError`` naming the problem)."""
        if lora is None:
            return None
        if not self.config.enable_lora:
            raise ValueError("lora_request: LoRA is off for this engine (enable_lora=True)")
        if isinstance(lora, str):
            found = self.loras.get(lora)
            if found is None:
                raise ValueError(f"lora_request: no adapter named {lora!r} in lora_modules")
            return found
        key = (lora.lora_int_id, lora.lora_path)
        if key not in self._checked_loras:
            inspect_adapter(lora.lora_path, self.loras.model_cfg, self.config.max_lora_rank)
            self._checked_loras[key] = lora.digest or adapter_digest(lora.lora_path)
        # the digest of the files when first seen: the core refuses them if they changed since
        return msgspec.structs.replace(lora, digest=self._checked_loras[key])

    def _chat_prompt(self, conversation: list[dict], processor_kwargs) -> ProcessedPrompt:
        """OpenAI-style messages (``image_url`` parts, or ``image`` parts holding PIL
        images) -> a processed prompt."""
        images = []
        for where in image_parts(conversation):
            part = conversation[where.message]["content"][where.part]
            if where.url is not None:
                images.append(load_image_url(where.url, self.inputs.image_limits, where.where))
            elif part.get("image") is not None:  # a PIL image
                images.append(LoadedImage(part["image"].convert("RGB"), b""))
            else:
                raise ValueError(f"{where.where}: an image part needs image_url.url or image")
        return self.inputs.render_chat(conversation, images, None, processor_kwargs)

    def _prompt(self, prompt) -> ProcessedPrompt:
        if isinstance(prompt, ProcessedPrompt):
            return prompt
        if isinstance(prompt, str):
            return self.inputs.completion(prompt)
        if not isinstance(prompt, dict) or not ("prompt" in prompt or "prompt_token_ids" in prompt):
            raise ValueError(
                "prompts: each prompt must be a str or a dict with 'prompt' or 'prompt_token_ids'"
            )
        if prompt.get("multi_modal_data"):
            images = prompt["multi_modal_data"].get("image", [])
            images = images if isinstance(images, list) else [images]
            loaded = [
                i if isinstance(i, LoadedImage) else LoadedImage(i.convert("RGB"), b"")
                for i in images
            ]
            return self.inputs.prompt_with_images(
                prompt["prompt"],
                loaded,
                prompt.get("add_special_tokens", True),
                prompt.get("mm_processor_kwargs"),
            )
        if "prompt_token_ids" in prompt:
            processed = self.inputs.completion(list(prompt["prompt_token_ids"]))
            processed.text = prompt.get("prompt")
            return processed
        return self.inputs.completion(prompt["prompt"])

    def _add(
        self, prompt, params: SamplingParams, lora: LoRARequest | None = None, priority: int = 0
    ) -> tuple[RequestState, ProcessedPrompt]:
        if params.structured_outputs is not None:  # a bad spec: this call's ValueError
            validate_structured(params.structured_outputs)
        processed = self._prompt(prompt)
        cache_salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if cache_salt is not None and not (isinstance(cache_salt, str) and cache_salt):
            raise ValueError("cache_salt: must be a non-empty string")
        processed.salt_items(cache_salt)  # a tenant's images share with no other, as served
        features = [
            MMFeature(i.identifier, i.offset, i.length, px.tobytes(), list(px.shape))
            for i in processed.items
            for px in (i.pixels(),)
        ]
        state, children = fan_out(str(next(self._ids)), params, self.tokenizer, time.monotonic())
        for child_id, child_params in children:
            self.engine.add_request(
                EngineCoreRequest(
                    child_id,
                    processed.token_ids,
                    child_params,
                    mm_features=features,
                    cache_salt=cache_salt,
                    lora_request=lora,
                    priority=priority,
                )
            )
        return state, processed

    def _logprob_dicts(self, entries) -> list[dict[int, Logprob]]:
        out = []
        for ids, values, rank in entries:
            entry = {ids[0]: Logprob(values[0], rank, self.tokenizer.id_to_token_text(ids[0]))}
            for r, (tid, value) in enumerate(zip(ids[1:], values[1:], strict=True), start=1):
                entry.setdefault(tid, Logprob(value, r, self.tokenizer.id_to_token_text(tid)))
            out.append(entry)
        return out

    def _result(self, state: RequestState, prompt: ProcessedPrompt) -> RequestOutput:
        params = state.params
        result = RequestOutput(state.request_id, prompt.text, prompt.token_ids, [], True)
        result.num_cached_tokens = state.num_cached_tokens
        if state.prompt_logprobs is not None:
            result.prompt_logprobs = [None] + self._logprob_dicts(state.prompt_logprobs[1:])
        result.params = params
        for seq in sorted(state.seqs.values(), key=lambda s: s.index):
            logprobs = self._logprob_dicts(seq.logprobs) if params.logprobs is not None else None
            cumulative = sum(v[0] for _, v, _ in seq.logprobs) if logprobs is not None else None
            result.outputs.append(
                CompletionOutput(
                    seq.index,
                    seq.detok.text,
                    seq.token_ids,
                    cumulative,
                    logprobs,
                    seq.finish_reason or ("abort" if state.error else None),
                    seq.stop_reason,
                )
            )
        return result
