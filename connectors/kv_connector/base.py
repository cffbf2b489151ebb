"""The KV-connector seam (vLLM v1 shape): one class, two roles, plain values across.

The scheduler-side instance decides what to load and save and hands the worker-side
instance a ``KVConnectorMetadata`` each step (inside the scheduler output); the worker side
moves blocks between the paged KV cache and the store and reports back a
``KVConnectorOutput`` (inside the model-runner output). Nothing here imports the engine:
requests are seen through the small ``KVRequest`` protocol.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import msgspec

from epdserve.connectors.storage.kv_io import HeadSlice


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


@dataclass(frozen=True)
class KVLayout:
    """What makes stored blocks interchangeable between pods (see DESIGN.md §3)."""

    fingerprint: str  # model + dtype + cache geometry
    block_size: int
    hash_algo: str
    num_kv_heads: int  # the model's, whatever the TP
    value_heads: int = 0  # KV heads per value this pod's ranks write (its TP's share; 0: all)


@dataclass(frozen=True)
class KVShard:
    """A tensor-parallel rank's part of the worker side: the KV heads its cache holds, and
    ``all_reduce`` (sums a tensor over the ranks, in place), which every rank's worker half
    calls at the same point of a step so that all ranks report the same transfers done."""

    heads: HeadSlice
    all_reduce: Callable[[Any], Any]


class KVRequest(Protocol):
    """What a connector reads of an engine request."""

    request_id: str
    block_hashes: list[bytes]  # one per full block of tokens, chained
    all_token_ids: list[int]
    num_tokens: int
    num_prompt_tokens: int
    num_computed_tokens: int
    kv_transfer_params: dict[str, Any] | None


class ScheduledRequest(NamedTuple):
    """A request scheduled this step: its blocks and its computed tokens after the step."""

    request: KVRequest
    block_ids: list[int]
    num_computed_tokens: int


class BlockTransfer(msgspec.Struct, array_like=True):
    """Blocks of one request to move: ``block_ids[i]`` holds the block named ``block_hashes[i]``.
    ``tail_tokens`` > 0: the last block is a prompt's partial last block (named by its tail
    hash), of which only the first ``tail_tokens`` tokens move. ``part_heads`` (loads): KV
    heads per stored value, as the pod that wrote them cut them (0: as this pod does)."""

    req_id: str
    block_ids: list[int]
    block_hashes: list[bytes]
    tail_tokens: int = 0
    part_heads: int = 0


class KVConnectorMetadata(msgspec.Struct, array_like=True, omit_defaults=True):
    """Scheduler side -> worker side, once per step."""

    loads: list[BlockTransfer] = []  # start now; the request waits until they finish
    saves: list[BlockTransfer] = []  # after this step's forward (the blocks are full then)


class KVConnectorOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """Worker side -> scheduler, once per step."""

    finished_sending: list[str] = []  # finished requests whose saves are all done
    finished_recving: list[str] = []  # requests whose loads are done (failed or not)
    invalid_block_ids: list[int] = []  # blocks a finished load could not fill
    saved: list[tuple[bytes, bool]] = []  # (block hash, stored?) of saves done since the last
    missed: list[bytes] = []  # blocks loads done since the last output found gone from the store


class KVConnectorStats(msgspec.Struct, frozen=True):
    """A connector's transfer counters since it started (the worker side moves the blocks)."""

    saved: int = 0  # blocks stored (every part of them, by every rank that stores)
    save_failures: int = 0  # blocks the store could not take (a part of them, on some rank)
    loaded: int = 0  # blocks copied into the paged cache (on every rank)
    misses: int = 0  # blocks a load could not fill: a value absent (never stored, evicted,
    # expired) or refused, on some rank
    rejected: int = 0  # stored values refused (``rejections`` says why): deleted


class KVConnectorBase(ABC):
    """A KV connector; ``role`` says which half of the methods an instance serves."""

    def __init__(self, role: KVConnectorRole):
        self.role = role

    # --- scheduler side -------------------------------------------------------------
    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: KVRequest, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` the connector can load, and whether the load
        is asynchronous; ``None`` while a lookup is still in flight (ask again next step). Whole
        blocks, except that the last one may be partial (a prompt's last block a prefill pod
        saved); never the prompt's last token. Mutates only the connector's bookkeeping."""

    @abstractmethod
    def update_state_after_alloc(
        self, request: KVRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """Blocks are allocated: queue a load of the ``num_external_tokens`` tokens that
        follow the locally computed ones into ``block_ids`` (the request's whole block list;
        the last block loaded may be partly filled)."""

    @abstractmethod
    def build_connector_meta(self, scheduled: list[ScheduledRequest]) -> KVConnectorMetadata:
        """This step's loads (queued since the last call) and saves (blocks that become full
        in this step's forward). Resets the queued loads."""

    @abstractmethod
    def request_finished(
        self, request: KVRequest, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``(delay_free, kv_transfer_params)``: whether the blocks must outlive the request
        until ``finished_sending`` names it, and what to hand the next pod (None: nothing).
        Forgets the request."""

    def update_connector_output(self, output: KVConnectorOutput) -> None:  # noqa: B027
        """The worker side's report of a step, before the scheduler applies it. A connector
        keeps what it needs (e.g. finished saves it turns into KV events). Mutates only the
        connector's bookkeeping."""

    def take_events(self) -> list:
        """KV events (``epdserve.connectors.kv_events``) this connector produced since the
        last call, e.g. blocks stored to (or found gone from) a shared store. Forgets them."""
        return []

    def step_failed(self, metadata: KVConnectorMetadata) -> None:  # noqa: B027
        """The step that carried ``metadata`` never ran its forward: the blocks its saves
        name were not computed. Forget having planned them (they are planned again when the
        request is recomputed). Its loads are handed to the worker with the next step."""

    # --- worker side ----------------------------------------------------------------
    @abstractmethod
    def register_kv_caches(self, kv_cache: Any) -> None:
        """The paged cache ``[num_blocks, layers, 2, block_size, kv_heads, head_dim]`` (at TP > 1
        this rank's KV heads only)."""

    @abstractmethod
    def bind_connector_metadata(self, metadata: KVConnectorMetadata | None) -> None:
        """This step's instructions (before the forward)."""

    @abstractmethod
    def start_load_kv(self) -> None:
        """Start the bound loads in the background (they fill blocks no one reads yet)."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until ``layer_name`` is loaded. Whole cross-layer blocks are loaded before
        their request is scheduled, so this never waits."""
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any) -> None:
        """Per-layer save hook. Blocks are cross-layer spans saved whole in ``wait_for_save``."""
        return None

    @abstractmethod
    def wait_for_save(self) -> None:
        """After the forward: hand the bound saves to the background writer. Their blocks
        stay allocated until ``get_finished`` reports the request."""

    @abstractmethod
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """``(done_sending, done_recving)``: finished requests (``finished_req_ids`` are this
        step's finished or preempted ones) whose saves are done, and requests whose loads are
        done. At TP > 1 every rank calls it in the same step and gets the same answer: done on
        every rank (a collective). Forgets what it reports."""

    @abstractmethod
    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks of loads reported done that could not be filled on any rank (and every later
        block of the same load, since a prefix is only usable up to its first hole). Resets
        the set."""

    def close(self) -> None:
        """Finish background work and release the store."""
        return None

    # --- either side ----------------------------------------------------------------------
    def stats(self) -> KVConnectorStats:
        """This instance's transfer counters (a snapshot; mutates nothing)."""
        return KVConnectorStats()

    def rejections(self) -> dict[str, int]:
        """Stored values this instance refused on load (each one deleted), by reason."""
        return {}

    # --- shared helpers -----------------------------------------------------------------
    def take_output(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        sending, recving = self.get_finished(finished_req_ids)
        return KVConnectorOutput(
            sorted(sending), sorted(recving), sorted(self.get_block_ids_with_load_errors())
        )
