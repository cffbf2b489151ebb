"""What a single request may ask for, checked before anything reaches the engine core.

Every check raises ``APIError(400, ...)`` naming the field, so one hostile or careless
request is answered in OpenAI's error shape and never costs the pod more than its parse.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from epdserve.engine.entrypoints.openai.errors import APIError

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


@dataclass(frozen=True)
class RequestLimits:
    max_logprobs: int = 20  # logprobs / top_logprobs / prompt_logprobs (vLLM's default)
    max_n: int = 128  # parallel samples per prompt (OpenAI's bound)
    max_prompts: int = 256  # prompts in one completions request
    max_stop: int = 64  # stop strings
    max_stop_len: int = 1024  # characters per stop string
    max_stop_token_ids: int = 1024
    max_cache_salt_len: int = 1024
    max_logit_bias: int = 1024  # entries of logit_bias
    max_body_bytes: int = 32 << 20  # whole request body (413 above)
    max_images: int = 8  # --limit-mm-per-prompt '{"image": N}'


# OpenAI/vLLM request fields this server accepts but does not act on: harmless only at the
# values listed (None always is). Any other value, or any other unknown field, is a 400.
# (Chat declares tools, tool_choice and parallel_tool_calls: these entries serve completions.)
TOLERATED: dict[str, tuple] = {
    "tools": ([],),
    "tool_choice": ("none", "auto"),
    "functions": ([],),
    "function_call": ("none", "auto"),
    "parallel_tool_calls": (True, False),
    "store": (False,),
    "service_tier": ("auto", "default"),
    "modalities": (["text"],),
    "use_beam_search": (False,),
    "length_penalty": (1.0, 1),
    "spaces_between_special_tokens": (True,),
    "truncate_prompt_tokens": (),
    "metadata": None,  # any value: informational only
    "prompt_cache_key": None,
    "safety_identifier": None,
}


def check_unknown_fields(extra: dict[str, Any] | None) -> None:
    """Unknown fields are refused rather than silently ignored (a sampling control that
    is ignored would change results without a word)."""
    for name, value in (extra or {}).items():
        if name not in TOLERATED:
            raise APIError(400, f"{name}: unrecognized request argument", name)
        allowed = TOLERATED[name]
        if value is None or allowed is None:
            continue
        if value not in allowed:
            raise APIError(400, f"{name}: not supported by this server (got {value!r})", name)


def check_priority(priority: int, policy: str) -> None:
    """A ``priority`` other than 0 is honoured only under ``--scheduling-policy priority``;
    elsewhere it is refused rather than silently ignored."""
    if priority != 0 and policy != "priority":
        raise APIError(
            400,
            f"priority: {priority} needs a server started with --scheduling-policy priority "
            "(this one serves in arrival order: fcfs)",
            "priority",
        )


def check_finite(req, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(req, name, None)
        if value is not None and not math.isfinite(value):
            raise APIError(400, f"{name}: must be a finite number, got {value}", name)


def check_count(value: int | None, limit: int, name: str) -> None:
    if value is None:
        return
    if value < 0:
        raise APIError(400, f"{name}: must be non-negative, got {value}", name)
    if value > limit:
        raise APIError(
            400, f"{name}: at most {limit} are supported by this server, got {value}", name
        )


def check_sampling_fields(req, limits: RequestLimits, vocab_size: int) -> None:
    """Fields common to completions and chat completions."""
    check_unknown_fields(req.model_extra)
    check_finite(
        req,
        (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ),
    )
    if req.n < 1 or req.n > limits.max_n:
        raise APIError(400, f"n: must be between 1 and {limits.max_n}, got {req.n}", "n")
    best_of = getattr(req, "best_of", None)
    if best_of is not None and best_of != req.n:
        raise APIError(400, f"best_of: only best_of == n is supported, got {best_of}", "best_of")
    check_count(req.prompt_logprobs, limits.max_logprobs, "prompt_logprobs")
    if req.seed is not None and not INT64_MIN <= req.seed <= INT64_MAX - (req.n - 1):
        raise APIError(400, f"seed: must be a 64-bit signed integer, got {req.seed}", "seed")
    if req.top_k is not None and req.top_k >= vocab_size:
        req.top_k = 0  # keeping every token is what a k past the vocabulary means
    if req.top_k is not None and req.top_k < -1:
        raise APIError(400, f"top_k: must be -1 (disable) or at least 1, got {req.top_k}", "top_k")
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > limits.max_stop:
        raise APIError(400, f"stop: at most {limits.max_stop} stop strings", "stop")
    if any(len(s) > limits.max_stop_len for s in stops):
        raise APIError(400, f"stop: each stop string is at most {limits.max_stop_len} long", "stop")
    ids = req.stop_token_ids or []
    if len(ids) > limits.max_stop_token_ids:
        raise APIError(
            400, f"stop_token_ids: at most {limits.max_stop_token_ids}", "stop_token_ids"
        )
    if any(t < 0 or t >= vocab_size for t in ids):
        raise APIError(400, "stop_token_ids: ids must be within the vocabulary", "stop_token_ids")
    check_logit_bias(req.logit_bias, limits, vocab_size)
    if req.cache_salt is not None and not 0 < len(req.cache_salt) <= limits.max_cache_salt_len:
        raise APIError(
            400,
            f"cache_salt: must be a non-empty string of at most {limits.max_cache_salt_len}",
            "cache_salt",
        )


def check_logit_bias(bias: dict[str, float] | None, limits: RequestLimits, vocab: int) -> None:
    """OpenAI's shape: token ids as strings, biases in [-100, 100]."""
    if not bias:
        return
    if len(bias) > limits.max_logit_bias:
        raise APIError(400, f"logit_bias: at most {limits.max_logit_bias} entries", "logit_bias")
    for token, value in bias.items():
        if not token.isdigit() or int(token) >= vocab:
            raise APIError(
                400, f"logit_bias: {token!r} is not a token id of this model", "logit_bias"
            )
        if not (math.isfinite(value) and -100.0 <= value <= 100.0):
            raise APIError(400, f"logit_bias: {value} is not in [-100, 100]", "logit_bias")


def find_surrogate(value: Any, path: str = "") -> str | None:
    """The path of the first string holding a lone UTF-16 surrogate (JSON allows ``\\ud800``;
    no tokenizer or encoder can take it)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = ((f"[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    for key, item in items:
        if isinstance(key, str) and find_surrogate(key) is not None:
            return path or "body"
        sub = f"{path}{key}" if key.startswith("[") else f"{path}.{key}" if path else key
        hit = find_surrogate(item, sub)
        if hit is not None:
            return hit
    return None
