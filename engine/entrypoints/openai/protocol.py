"""OpenAI request schemas (pydantic) and their mapping onto ``SamplingParams``."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from epdserve.engine.entrypoints.openai.limits import INT64_MAX, INT64_MIN, find_surrogate
from epdserve.engine.sampling_params import RequestOutputKind, SamplingParams


class _ValidText(BaseModel):
    """Refuses strings no tokenizer can take (JSON's lone surrogates), naming where."""

    @model_validator(mode="before")
    @classmethod
    def _no_lone_surrogates(cls, data: Any) -> Any:
        where = find_surrogate(data)
        if where is not None:
            raise ValueError(f"{where}: contains a lone surrogate, which is not valid Unicode")
        return data


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Common(_ValidText):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    user: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    cache_salt: str | None = None
    # lower is served earlier under --scheduling-policy priority (vLLM's field and bounds)
    priority: StrictInt = Field(0, ge=INT64_MIN, le=INT64_MAX)
    # the prompt as a previous pod of the pool processed it (engine/inputs/prompt.py): this
    # pod then neither renders, tokenizes nor loads images
    processed_prompt: dict[str, Any] | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias
    bad_words: list[str] | None = None  # vLLM's: words the output may not contain
    # what the output must match (entrypoints/openai/structured_request.py): OpenAI's
    # response_format, vLLM's structured_outputs and its older guided_* names
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        kwargs = dict(
            n=self.n,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            output_kind=RequestOutputKind.DELTA,
            logit_bias={int(t): float(v) for t, v in self.logit_bias.items()}
            if self.logit_bias
            else None,
            bad_words=list(self.bad_words or []),
        )
        for name, default in (
            ("temperature", 1.0),
            ("top_p", 1.0),
            ("top_k", 0),
            ("min_p", 0.0),
            ("presence_penalty", 0.0),
            ("frequency_penalty", 0.0),
            ("repetition_penalty", 1.0),
        ):
            value = getattr(self, name)
            kwargs[name] = default if value is None else value
        return SamplingParams(**kwargs)


Prompt = Annotated[str | list[str] | list[int] | list[list[int]], Field(union_mode="left_to_right")]


class CompletionRequest(_Common):
    prompt: Prompt
    add_special_tokens: bool = True  # the tokenizer's BOS/EOS around a text prompt
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ImageURL(BaseModel):
    url: str
    detail: str | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["text", "image_url", "input_image", "image"]
    text: str | None = None
    image_url: ImageURL | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    echo: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None  # e.g. {"do_pan_and_scan": true}
    add_special_tokens: bool = False  # on top of the template's own (vLLM's default)
    # function calling (entrypoints/openai/tool_request.py); tools reach the template as given
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class TokenizeRequest(_ValidText):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(BaseModel):
    """``POST /v1/load_lora_adapter`` (vLLM's shape)."""

    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(BaseModel):
    """``POST /v1/unload_lora_adapter`` (vLLM's shape)."""

    lora_name: str
    lora_int_id: int | None = None
