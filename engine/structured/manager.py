"""The core side of structured outputs: grammars compiled off the step loop, one matcher per
request, each step's token bitmask for the requests that sample under a grammar.

A request with a grammar waits in the queue (others keep stepping) until its grammar is
compiled; compiled grammars are shared by spec (``StructuredOutputsParams.key()``). Compiles
run in two lanes (compile_queue.py): cheap specs in one, the rest in the other, each lane
taking its clients in turn. A spec that fails to compile, or takes longer than
``compile_timeout_s``, fails its request with a 400 naming the field.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from typing import TYPE_CHECKING

from epdserve.engine.structured.backend import Compiler, tokenizer_info
from epdserve.engine.structured.compile_queue import CompileJob, CompileLane
from epdserve.engine.structured.schema_check import tag_schemas
from epdserve.engine.structured.schema_cost import SchemaCost

if TYPE_CHECKING:
    from epdserve.engine.core.interfaces import SchedulerOutput
    from epdserve.engine.core.request import Request
    from epdserve.engine.structured.params import StructuredOutputsParams

log = logging.getLogger("epdserve.structured")

CACHE_ENTRIES = 256  # compiled grammars kept (each ~10 kB - 1 MB)
DEFAULT_COMPILE_TIMEOUT_S = 30.0
# the cheap lane: specs of at most SMALL_SPEC_BYTES whose estimate is at most SMALL_COST
# (schema_cost.py: ~5 ms) and whose patterns cost at most SMALL_PATTERN_COST (pattern_cost.py)
SMALL_SPEC_BYTES = 4096
SMALL_COST = 100_000_000
SMALL_PATTERN_COST = 40_000
SHARED_CLIENT = ""  # requests that name no client share one turn
# tests only: large-lane compiles start once this file exists (at most HOLD_S later), so a
# served test can tell structurally what a held large lane still lets through. Unset in production
HOLD_ENV = "EPDSERVE_TEST_HOLD_LARGE_COMPILES"
HOLD_S = 60.0


def _hold(path: str | None) -> None:
    deadline = time.monotonic() + HOLD_S
    while path and not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)


def is_small(params: StructuredOutputsParams) -> bool:
    """Whether a spec compiles in milliseconds (its lane: ``small``)."""
    kind = params.kind
    if kind == "json_object":
        return True
    if len(params.spec_text().encode()) > SMALL_SPEC_BYTES:
        return False
    cost = SchemaCost()
    if kind == "json":
        cost.add(params.json)
    elif kind == "structural_tag":
        for schema in tag_schemas(params.structural_tag):
            cost.add(schema)
    return cost.total <= SMALL_COST and cost.pattern_units <= SMALL_PATTERN_COST


class GrammarState:
    """One request's grammar: compiling, then a matcher that follows its output."""

    __slots__ = ("future", "deadline", "matcher", "field")

    def __init__(self, future: Future, deadline: float, field: str):
        self.future, self.deadline, self.field = future, deadline, field
        self.matcher = None

    def ready(self) -> bool:
        """Compiled and matching (raises ``ValueError`` naming the field when it failed)."""
        if self.matcher is not None:
            return True
        if not self.future.done():
            if time.monotonic() > self.deadline:
                raise ValueError(f"{self.field}: the grammar did not compile in time")
            return False
        if self.future.cancelled():  # the engine is closing
            raise ValueError(f"{self.field}: the grammar compile was cancelled")
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(self.future.result())  # re-raises a compile error
        return True

    def accept(self, token_ids: list[int]) -> None:
        for t in token_ids:
            if not self.matcher.accept_token(t):
                raise RuntimeError(f"{self.field}: sampled token {t} is outside the grammar")

    @property
    def terminated(self) -> bool:
        return self.matcher is not None and self.matcher.is_terminated()


class StructuredOutputManager:
    """Compiles and caches grammars; fills the bitmask of each step's constrained rows."""

    def __init__(
        self,
        model_dir: str,
        vocab_size: int,
        stop_token_ids: list[int],
        max_rows: int,
        compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
    ):
        self.model_dir, self.vocab_size = model_dir, vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.max_rows = max_rows
        self.compile_timeout_s = compile_timeout_s
        # two lanes, so a cheap spec never waits behind a large one; each takes its clients
        # in turn and drops compiles nobody waits for (compile_queue.py)
        self._lock = threading.Lock()
        hold = os.environ.get(HOLD_ENV)
        self.lanes = {
            "small": CompileLane("small", lambda p: self._compile(p), self._lock),
            "large": CompileLane("large", lambda p: _hold(hold) or self._compile(p), self._lock),
        }
        self._compiler: Compiler | None = None  # built by the first compile
        self._compiler_lock = threading.Lock()
        self._cache: OrderedDict[tuple, CompileJob] = OrderedDict()
        self._bitmask = None  # [max_rows, ceil(vocab / 32)] int32, allocated on first use
        self._batch = None  # xgrammar's batch matcher: fills every row in one call
        self._live: dict[str, Request] = {}  # the requests with a grammar, not yet seen gone
        self.compiles = 0
        self.cache_hits = 0

    @property
    def dropped(self) -> int:
        """Compiles dropped because every request waiting for them had gone."""
        return sum(lane.dropped for lane in self.lanes.values())

    def add(self, request: Request, client: str | None = None) -> None:
        """Start (or share) the compile of a new request's grammar; ``client`` (who sent it)
        takes turns with the other clients of its lane."""
        params = request.params.structured_outputs
        key = params.key()
        with self._lock:  # a lane's thread may be dropping this very job
            job = self._cache.get(key)
            if job is None or job.future.cancelled():
                job = self._queue(key, params, client, request)
            else:
                job.waiters.append(request)
                self._cache.move_to_end(key)
                self.cache_hits += 1
        deadline = time.monotonic() + self.compile_timeout_s
        field = f"structured_outputs.{params.kind}"
        request.grammar = GrammarState(job.future, deadline, field)
        self._live[request.request_id] = request

    def _queue(self, key, params, client, request) -> CompileJob:
        job = CompileJob(params, client or SHARED_CLIENT, request)
        self.lanes["small" if is_small(params) else "large"].put(job)
        self._cache[key] = job
        self.compiles += 1
        while len(self._cache) > CACHE_ENTRIES:
            self._cache.popitem(last=False)
        return job

    def _compile(self, params: StructuredOutputsParams):
        with self._compiler_lock:
            if self._compiler is None:
                info = tokenizer_info(self.model_dir, self.vocab_size, self.stop_token_ids)
                self._compiler = Compiler(info, threads=min(4, os.cpu_count() or 1))
        start = time.perf_counter()
        compiled = self._compiler.compile(params)
        log.debug("compiled a %s grammar in %.3f s", params.kind, time.perf_counter() - start)
        return compiled

    def fill(self, sched: SchedulerOutput, requests: dict[str, Request]) -> None:
        """Give ``sched`` the allowed tokens of its rows that sample under a grammar. Steps
        with no request under a grammar cost one dict check."""
        if not self._live:
            return
        for req_id in [i for i, r in self._live.items() if requests.get(i) is not r]:
            del self._live[req_id]  # finished or aborted since
        scheduled = sched.num_scheduled_tokens
        rows = [
            r
            for i, r in self._live.items()
            if i in scheduled and r.num_computed_tokens >= r.num_tokens
        ]
        if rows:
            sched.grammar_req_ids = [r.request_id for r in rows]
            sched.grammar_bitmask = self.bitmask(rows)

    def bitmask(self, requests: list[Request]) -> bytes:
        """The packed allowed-token rows of ``requests`` (each samples this step), in order."""
        import xgrammar as xgr

        if self._bitmask is None:
            self._bitmask = xgr.allocate_token_bitmask(self.max_rows, self.vocab_size)
            self._batch = xgr.BatchGrammarMatcher()
        matchers = [r.grammar.matcher for r in requests]
        self._batch.batch_fill_next_token_bitmask(matchers, self._bitmask)  # one C++ call
        return self._bitmask[: len(requests)].numpy().tobytes()

    def close(self) -> None:
        for lane in self.lanes.values():
            lane.close()
