"""Offline inference: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from epdserve.engine.config import EngineConfig
from epdserve.engine.core.engine_core import EngineCore, EngineCoreRequest
from epdserve.engine.core.interfaces import EngineCoreOutput, Logprobs, MMFeature
from epdserve.engine.outputs.detokenizer import IncrementalDetokenizer
from epdserve.engine.inputs.images import LoadedImage
from epdserve.engine.outputs.request_output import CompletionOutput, Logprob, RequestOutput
from epdserve.engine.sampling_params import SamplingParams
from epdserve.engine.tokenizer import TokenizerInfo


@dataclass
class _Sequence:
    """One of a prompt's ``n`` samples, as the frontend tracks it."""

    index: int
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class LLM:
    """A whole engine in this process; ``generate`` runs requests to completion."""

    def __init__(self, model: str, **kwargs):
        self.config = EngineConfig(model=str(model), **kwargs)
        self.engine = EngineCore(self.config)
        self.tokenizer = TokenizerInfo(model)
        self._ids = itertools.count()
        self._images = None  # the image processor, built on first use

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = sampling_params if sampling_params is not None else SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("sampling_params: the list must have one entry per prompt")
        results = [self._add(p, sp) for p, sp in zip(prompts, params_list, strict=True)]
        by_child = {cid: (res, seq) for res, seqs in results for cid, seq in seqs.items()}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                self._process(out, *by_child[out.request_id])
        return [self._finish(res, seqs) for res, seqs in results]

    def chat(
        self,
        messages: list[dict],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = False,
        mm_processor_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """One conversation (or a list of them) of OpenAI-style messages; images allowed.
        ``mm_processor_kwargs`` overrides the engine's image-processor options."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [self._chat_prompt(c) for c in conversations]
        if mm_processor_kwargs is not None:
            for prompt in prompts:
                prompt["mm_processor_kwargs"] = mm_processor_kwargs
        return self.generate(prompts, sampling_params, use_tqdm)

    def _chat_prompt(self, conversation: list[dict]) -> dict:
        """OpenAI-style messages (text and image parts) -> a prompt dict for ``generate``."""
        images = []
        for i, message in enumerate(conversation):
            content = message.get("content")
            for j, part in enumerate(content if isinstance(content, list) else []):
                if part.get("type") == "image_url":
                    url = (
                        part["image_url"]["url"]
                        if isinstance(part["image_url"], dict)
                        else part["image_url"]
                    )
                    images.append(self._multimodal().load(url, f"messages[{i}].content[{j}]"))
                elif part.get("type") == "image":
                    images.append(LoadedImage(part["image"].convert("RGB"), b""))
        text = self.tokenizer.apply_chat_template(conversation)
        if not images:
            return {"prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)}
        return {"prompt": text, "multi_modal_data": {"image": images}, "add_special_tokens": False}

    def _multimodal(self):
        if self._images is None:
            from epdserve.engine.inputs.frontend import FrontendMultimodal

            self._images = FrontendMultimodal(
                self.config.model,
                self.config.model,
                self.tokenizer,
                processor_kwargs=self.config.mm_processor_kwargs,
            )
        return self._images

    def _mm_prompt(self, prompt: dict) -> tuple[list[int], list[MMFeature]]:
        images = prompt["multi_modal_data"].get("image", [])
        images = images if isinstance(images, list) else [images]
        loaded = [
            i if isinstance(i, LoadedImage) else LoadedImage(i.convert("RGB"), b"") for i in images
        ]
        return self._multimodal().process(
            prompt["prompt"],
            loaded,
            prompt.get("add_special_tokens", True),
            prompt.get("mm_processor_kwargs"),
        )

    def _add(self, prompt, params: SamplingParams):
        mm_features = []
        if isinstance(prompt, dict) and prompt.get("multi_modal_data"):
            text = prompt["prompt"]
            token_ids, mm_features = self._mm_prompt(prompt)
        elif isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, token_ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
        elif isinstance(prompt, dict) and "prompt" in prompt:
            text, token_ids = prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        else:
            raise ValueError(
                "prompts: each prompt must be a str or a dict with 'prompt' or 'prompt_token_ids'"
            )
        cache_salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if cache_salt is not None and not (isinstance(cache_salt, str) and cache_salt):
            raise ValueError("cache_salt: must be a non-empty string")
        request_id = str(next(self._ids))
        result = RequestOutput(request_id, text, token_ids, [], False)
        seqs = {}
        for i in range(params.n):
            child = params.for_child(i) if params.n > 1 else params
            child_id = f"{request_id}-{i}" if params.n > 1 else request_id
            detok = IncrementalDetokenizer(
                self.tokenizer,
                child.stop,
                child.skip_special_tokens,
                child.include_stop_str_in_output,
            )
            seqs[child_id] = _Sequence(
                i, detok, logprobs=[] if child.logprobs is not None else None
            )
            self.engine.add_request(
                EngineCoreRequest(
                    child_id, token_ids, child, mm_features=mm_features, cache_salt=cache_salt
                )
            )
        if params.prompt_logprobs is not None:
            result.prompt_logprobs = [None]
        result.params = params
        return result, seqs

    def _process(self, out: EngineCoreOutput, result: RequestOutput, seq: _Sequence) -> None:
        result.num_cached_tokens = max(result.num_cached_tokens, out.num_cached_tokens)
        if out.new_prompt_logprobs is not None and seq.index == 0:
            result.prompt_logprobs.extend(self._logprob_dicts(out.new_prompt_logprobs))
        seq.token_ids.extend(out.new_token_ids)
        if out.new_logprobs is not None and seq.logprobs is not None:
            dicts = self._logprob_dicts(out.new_logprobs)
            seq.logprobs.extend(dicts)
            chosen = sum(
                lp.logprob
                for d, t in zip(dicts, out.new_token_ids, strict=False)
                for tid, lp in d.items()
                if tid == t
            )
            seq.cumulative_logprob = (seq.cumulative_logprob or 0.0) + chosen
        stop = seq.detok.update(out.new_token_ids)
        if stop is not None and out.finish_reason is None:
            self.engine.abort_requests([out.request_id])
            seq.finish_reason, seq.stop_reason = "stop", stop
        elif out.finish_reason is not None:
            seq.finish_reason, seq.stop_reason = out.finish_reason, out.stop_reason

    def _logprob_dicts(self, lp: Logprobs) -> list[dict[int, Logprob]]:
        out = []
        for ids, values, rank in zip(lp.token_ids, lp.logprobs, lp.ranks, strict=True):
            entry = {ids[0]: Logprob(values[0], rank, self.tokenizer.id_to_token_text(ids[0]))}
            for r, (tid, value) in enumerate(zip(ids[1:], values[1:], strict=True), start=1):
                entry.setdefault(tid, Logprob(value, r, self.tokenizer.id_to_token_text(tid)))
            out.append(entry)
        return out

    def _finish(self, result: RequestOutput, seqs: dict[str, _Sequence]) -> RequestOutput:
        result.outputs = [
            CompletionOutput(
                s.index,
                s.detok.text,
                s.token_ids,
                s.cumulative_logprob,
                s.logprobs,
                s.finish_reason,
                s.stop_reason,
            )
            for s in sorted(seqs.values(), key=lambda s: s.index)
        ]
        result.finished = True
        return result
