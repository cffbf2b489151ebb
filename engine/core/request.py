"""A request as the engine core sees it (vLLM v1: computed tokens catch up with tokens)."""

from __future__ import annotations

import enum
import time

from epdserve.engine.core.hashing import BlockHash, BlockHasher
from epdserve.engine.lora.request import LoRARequest
from epdserve.engine.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    WAITING_FOR_REMOTE_KVS = 1  # a KV connector is loading its prefix
    RUNNING = 2
    PREEMPTED = 3
    # finished states come after this line
    FINISHED_STOPPED = 4
    FINISHED_LENGTH_CAPPED = 5
    FINISHED_ABORTED = 6

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS[self]


FINISH_REASONS = (None, None, None, None, "stop", "length", "abort")  # by status


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_id: int | None = None,
        hasher: BlockHasher | None = None,
        arrival_time: float | None = None,
        kv_transfer_params: dict | None = None,
        mm_features: list | None = None,
        cache_salt: str | None = None,
        lora: LoRARequest | None = None,
        priority: int = 0,
    ):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.eos_token_id = eos_token_id
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        # overlapped scheduling: tokens sampled by steps in flight, not yet known here
        self.num_output_placeholders = 0
        self.num_cached_tokens = -1  # set when first scheduled
        self.num_external_computed_tokens = 0  # of those, loaded by a KV connector
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.priority = priority  # lower is served earlier (scheduling_policy "priority")
        self.max_tokens = params.max_tokens if params.max_tokens is not None else 1 << 62
        # the stop check's parameters, read once per token (``sched_utils.check_stop``)
        self.min_tokens = params.min_tokens
        self.stop_eos = None if params.ignore_eos else eos_token_id  # EOS that ends it
        self.stop_token_ids = params.stop_token_ids
        self.block_hashes: list[BlockHash] = []
        self.mm_features = list(mm_features or [])
        self.mm_spans = tuple((f.offset, f.end, f.identifier) for f in self.mm_features)
        self.cache_salt = cache_salt or None  # a tenant's: its blocks share with no other salt
        self.lora = lora  # its adapter (None: the base model)
        self.lora_name = lora.lora_name if lora is not None else None
        self.lora_digest = lora.digest if lora is not None else None
        # its blocks' adapter key: name and the digest of the files (a reload names others)
        self.lora_key = tuple(k for k in (self.lora_name, self.lora_digest) if k)
        self._hasher = hasher
        self._hash_at = 1 << 62  # the token count at which the next block fills up
        if hasher is not None:
            self._extend_hashes()
        # prompt logprobs need every prompt position computed here, never read from cache
        self.skip_prefix_cache = params.prompt_logprobs is not None
        self.kv_transfer_params = kv_transfer_params  # P/D hand-over (vLLM's field)
        self.label: str | None = None  # the client's X-Request-Id: logs and tests only
        self.grammar = None  # its GrammarState when its output has a grammar (structured)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
        if len(self.all_token_ids) >= self._hash_at:  # a block just filled up
            self._extend_hashes()

    def _extend_hashes(self) -> None:
        hasher = self._hasher
        hasher.extend(
            self.block_hashes, self.all_token_ids, self.mm_spans, self.cache_salt, self.lora_key
        )
        self._hash_at = (len(self.block_hashes) + 1) * hasher.block_size

    def block_extra_keys(self, start: int, end: int) -> list | None:
        """The hash extra keys of blocks ``start..end-1`` as their KV events carry them (vLLM's
        shape: the adapter by name only, its digest travels in ``lora_digest``); None when no
        block of this request has any."""
        hasher = self._hasher
        if hasher is None or not (
            self.mm_spans or self.cache_salt or self.lora_name or hasher.extra_keys
        ):
            return None
        name = (self.lora_name,) if self.lora_name else ()
        return [
            hasher.block_extra_keys(i, self.mm_spans, self.cache_salt, name)
            for i in range(start, end)
        ]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, computed="
            f"{self.num_computed_tokens}/{self.num_tokens})"
        )
