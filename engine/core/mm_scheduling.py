"""Scheduling of multimodal inputs alongside tokens (vLLM v1 semantics, simplified).

A step that computes tokens of an image placeholder needs that image's encoder output:
cached (shared across requests by identifier) or computed this step within the encoder
budget. A chunk never ends inside a placeholder span (Gemma3's image tokens attend to
each other, so a span's K/V must be written in one forward).
"""

from __future__ import annotations

from epdserve.engine.core.encoder_cache_manager import EncoderCacheManager
from epdserve.engine.core.interfaces import MMFeature


def clip_to_spans(features: list[MMFeature], computed: int, n: int) -> int:
    """Shrink (or, for a span already entered, extend) ``n`` so no span is split."""
    end = computed + n
    for f in features:
        if f.offset < end < f.end:
            return f.offset - computed if f.offset > computed else f.end - computed
    return n


def plan_encoder_inputs(
    request_id: str,
    features: list[MMFeature],
    computed: int,
    n: int,
    cache: EncoderCacheManager,
    budget: int,
) -> tuple[int, list[int], int]:
    """``(n, indices of features to encode now, encoder tokens used)`` for one request.

    Features already cached are referenced; others are reserved in the cache and encoded
    this step if the budget allows, else the chunk stops before them.
    """
    to_encode, used = [], 0
    for idx, f in enumerate(features):
        if f.end <= computed or f.offset >= computed + n:
            continue
        if cache.check_and_update_cache(request_id, f.identifier):
            continue
        if f.length <= budget - used and cache.can_allocate(f.length):
            cache.allocate(request_id, f.identifier, f.length)
            to_encode.append(idx)
            used += f.length
            continue
        return max(0, f.offset - computed), to_encode, used
    return n, to_encode, used


def release_passed(
    request_id: str, features: list[MMFeature], computed: int, cache: EncoderCacheManager
) -> None:
    """Drop the request's references to images whose span is fully computed."""
    for f in features:
        if f.end <= computed:
            cache.free_encoder_input(request_id, f.identifier)


class EncoderScheduler:
    """The scheduler's multimodal side: one step's encoder inputs within a token budget."""

    def __init__(self, cache_tokens: int, budget_tokens: int, ec_connector=None):
        self.cache = EncoderCacheManager(cache_tokens)
        self.ec = ec_connector  # shared encoder-output store, if any
        self.budget = budget_tokens
        self.used = 0
        self.inputs: dict[str, list[int]] = {}

    def begin_step(self) -> None:
        self.used, self.inputs = 0, {}

    def fit(self, request, computed: int, n: int) -> int:
        """How many of ``n`` tokens may run now; reserves/encodes the images they need."""
        if not request.mm_features:
            return n
        n = clip_to_spans(request.mm_features, computed, n)
        n, todo, used = plan_encoder_inputs(
            request.request_id,
            request.mm_features,
            computed,
            n,
            self.cache,
            self.budget - self.used,
        )
        if todo:
            self.inputs.setdefault(request.request_id, []).extend(todo)
            self.used += used
        return n

    def after_step(self, request) -> None:
        if request.mm_features:
            release_passed(
                request.request_id, request.mm_features, request.num_computed_tokens, self.cache
            )

    def free(self, request) -> None:
        self.cache.free(request.request_id, [f.identifier for f in request.mm_features])

    def take_inputs(self) -> dict[str, list[int]]:
        inputs, self.inputs = self.inputs, {}
        return inputs

    def remote_items(self, requests: dict, inputs: dict[str, list[int]]) -> list[str]:
        """This step's encoder inputs to load from the shared store rather than encode: all
        of them on a consumer pod (one GET each; what misses is encoded, or fails its request
        when the pod never got its pixels). No existence check first: the pod that named an
        item without pixels (a processed prompt) was told it is stored."""
        if self.ec is None or not self.ec.config.is_consumer or not inputs:
            return []
        return sorted(
            {requests[r].mm_features[i].identifier for r, idxs in inputs.items() for i in idxs}
        )


def checked_mm_features(features: list, prompt_len: int, tokens_per_image: int) -> list:
    """A request's images validated against its prompt: spans must be placeholders in it."""
    for i, f in enumerate(features):
        if f.offset < 0 or f.end > prompt_len or f.length != tokens_per_image:
            raise ValueError(
                f"mm_features[{i}]: placeholder [{f.offset}, {f.end}) does not "
                f"fit a {prompt_len}-token prompt with {tokens_per_image} tokens per image"
            )
        f.check_buffer(i)
    return list(features)
