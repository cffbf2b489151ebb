"""The only objects crossing scheduler ↔ executor (and its workers) and core ↔ frontend: all
msgpack-able, so a worker in another process gets them as bytes, never pickled."""

from __future__ import annotations

from typing import Any

import msgspec

from epdserve.connectors.kv_connector import KVConnectorMetadata, KVConnectorOutput
from epdserve.engine.core.kv_cache_groups import KVCacheSpec
from epdserve.engine.lora.request import LoRARequest
from epdserve.engine.sampling_params import SamplingParams

# the status of a request whose images' encoder outputs no store could give and whose pixels
# this pod never got (evicted between the legs of a disaggregated pool): 503, so the router
# sends that leg again with the images (the pod's answer says so, see entrypoints/openai)
MISSING_ITEM_STATUS = 503


class MissingPixelsError(ValueError):
    """Images named without pixels whose encoder outputs no store could give. The runner
    names the requests they belong to (``request_ids``); those fail alone, with
    ``MISSING_ITEM_STATUS``, and the rest of the step runs again."""

    def __init__(self, identifiers: list[str], request_ids: list[str] | None = None):
        names = ", ".join(i[:16] for i in identifiers)
        super().__init__(
            f"image {names}: its encoder output is not in the shared store and this pod never "
            "got its pixels; send the request again with its images"
        )
        self.identifiers = identifiers
        self.request_ids = request_ids or []


class MMFeature(msgspec.Struct, array_like=True):
    """One multimodal item of a request: identifier, placeholder span, processed pixels."""

    identifier: str
    offset: int  # first placeholder token position in the prompt
    length: int  # number of placeholder tokens
    data: bytes  # raw little-endian buffer of the processed pixels; b"": named only
    shape: list[int]
    dtype: str = "float32"

    @property
    def end(self) -> int:
        return self.offset + self.length

    def check_buffer(self, index: int) -> None:
        """Refuse pixels whose bytes do not fill their shape (``ValueError`` naming it).
        No pixels at all is valid: the item is named only (see ``engine/core/pixel_cache``)."""
        if not self.data and not self.shape:
            return
        numel = 1
        for d in self.shape:
            numel *= d
        if self.dtype != "float32" or len(self.shape) != 3 or len(self.data) != 4 * numel:
            raise ValueError(
                f"mm_features[{index}]: pixel buffer does not match shape {self.shape}"
            )


class NewRequestData(msgspec.Struct, array_like=True):
    """A request the runner has not seen (or must rebuild after preemption)."""

    req_id: str
    token_ids: list[int]  # prompt + outputs so far
    params: SamplingParams
    block_ids: list[list[int]]  # per KV-cache group
    num_computed_tokens: int
    num_prompt_tokens: int
    mm_features: list[MMFeature] = []
    lora_slot: int = -1  # the adapter's device slot (-1: the base model)


class CachedRequestData(msgspec.Struct, array_like=True):
    req_ids: list[str]
    new_block_ids: list[list[list[int]]]  # per request, per KV-cache group
    num_computed_tokens: list[int]


class SchedulerOutput(msgspec.Struct, array_like=True):
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: list[str]  # the runner drops their state (finished or preempted)
    kv_connector_metadata: KVConnectorMetadata | None = None
    scheduled_encoder_inputs: dict[str, list[int]] = {}  # request -> indices of its mm items
    free_encoder_ids: list[str] = []  # encoder outputs the runner may drop
    encoder_loads: list[str] = []  # encoder inputs to load from the shared store, not encode
    # structured outputs: the requests that sample under a grammar this step and their
    # allowed tokens, one packed int32 row of ceil(vocab / 32) words each, in that order
    grammar_req_ids: list[str] = []
    grammar_bitmask: bytes = b""


class Logprobs(msgspec.Struct, array_like=True):
    """Per position: the top token ids/logprobs (sampled token first) and its rank."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


class WorkerStats(msgspec.Struct, array_like=True, omit_defaults=True):
    """A worker's counters since it started (the scheduler reads no worker state: they come
    with the step's output, whenever they changed)."""

    encoder_runs: int = 0  # images the vision encoder actually encoded
    encoder_loads: int = 0  # images loaded from the shared encoder-output store
    kv_save_failures: int = 0  # KV blocks its connector half could not store
    # stored values its connector halves refused on load (each deleted), by kind and reason
    store_rejections: dict[str, dict[str, int]] = {}


class ModelRunnerOutput(msgspec.Struct, array_like=True):
    req_ids: list[str]
    sampled_token_ids: list[list[int]]  # empty list: a partial prefill chunk, nothing sampled
    logprobs: dict[str, Logprobs] = {}
    prompt_logprobs: dict[str, Logprobs] = {}
    kv_connector_output: KVConnectorOutput | None = None
    worker_stats: WorkerStats | None = None  # None: unchanged since the last step's


class KVCacheConfig(msgspec.Struct, array_like=True):
    """The core's word to every worker on the paged KV cache it must allocate."""

    num_blocks: int
    spec: KVCacheSpec  # its groups, and the layers per group (the tensor's second dim)


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = 0.0
    kv_transfer_params: dict[str, Any] | None = None
    mm_features: list[MMFeature] = []
    cache_salt: str | None = None  # tenant isolation: folded into the first block's hash
    label: str | None = None  # the client's X-Request-Id: logs and test fault injection only
    lora_request: LoRARequest | None = None  # its adapter (None: the base model)
    priority: int = 0  # lower is served earlier under --scheduling-policy priority
    client: str | None = None  # who sent it (the API's peer): grammar compiles take turns by it


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: Logprobs | None = None
    new_prompt_logprobs: Logprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None  # for the next pod (P/D), on the last output
    ec_transfer_params: dict[str, Any] | None = None  # encoder pods: the items stored
    # the request failed (finish_reason "abort"): why, and the HTTP status the client gets
    # (400: the core refused its input; 500: an exception while serving it; 503: its images
    # must be sent again, MISSING_ITEM_STATUS)
    error: str | None = None
    error_status: int = 500


class SchedulerStats(msgspec.Struct, array_like=True):
    """Gauges as of this step; counters are cumulative since the core started."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_queries: int = 0
    prefix_hits: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    num_scheduled_tokens: int = 0
    external_queries: int = 0  # tokens looked up in a KV connector's store
    external_hits: int = 0  # tokens loaded from it
    kv_load_failures: int = 0  # blocks a load could not fill (recomputed instead)
    prompt_tokens_by_source: list[int] = []  # computed here, local cache hit, loaded
    mm_queries: int = 0  # encoder-cache lookups (images)
    mm_hits: int = 0  # of which served from the encoder cache
    encoder_runs: int = 0  # images the vision encoder actually encoded
    encoder_loads: int = 0  # images loaded from the shared encoder-output store
    failed_steps: int = 0  # steps whose execution raised (contained by the step guard)
    kv_save_failures: int = 0  # KV blocks a connector could not store (full, down, read-only)
    # stored values refused on load and deleted: {"kv_block"|"encoder_output": {reason: n}}
    store_rejections: dict[str, dict[str, int]] = {}
    # the KV-event publisher's counters (batches published/dropped, replays, auth denied...)
    kv_events: dict[str, int] = {}
    # CPU seconds of this process (every thread) while the model ran: what the pod spends
    # outside the model is its processes' CPU time minus this
    model_cpu_seconds: float = 0.0
    # adapters of the running and the waiting requests, sorted (vllm:lora_requests_info)
    running_loras: list[str] = []
    waiting_loras: list[str] = []


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    outputs: list[EngineCoreOutput] = []
    timestamp: float = 0.0
    stats: SchedulerStats | None = None
