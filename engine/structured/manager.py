"""The core side of structured outputs: grammars compiled off the step loop, one matcher per
request, each step's token bitmask for the requests that sample under a grammar.

A request with a grammar waits in the queue (others keep stepping) until its grammar is
compiled; compiled grammars are shared by spec (``StructuredOutputsParams.key()``). A spec
that fails to compile, or takes longer than ``compile_timeout_s``, fails its request with a
400 naming the field.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from epdserve.engine.structured.backend import Compiler, tokenizer_info

if TYPE_CHECKING:
    from epdserve.engine.core.interfaces import SchedulerOutput
    from epdserve.engine.core.request import Request
    from epdserve.engine.structured.params import StructuredOutputsParams

log = logging.getLogger("epdserve.structured")

CACHE_ENTRIES = 256  # compiled grammars kept (each ~10 kB - 1 MB)
DEFAULT_COMPILE_TIMEOUT_S = 30.0


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
        # one thread: compiles queue behind each other, never behind the step loop
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._compiler: Compiler | None = None  # built by the pool thread on first use
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._bitmask = None  # [max_rows, ceil(vocab / 32)] int32, allocated on first use
        self._batch = None  # xgrammar's batch matcher: fills every row in one call
        self._live: dict[str, Request] = {}  # the requests with a grammar, not yet seen gone
        self.compiles = 0
        self.cache_hits = 0

    def add(self, request: Request) -> None:
        """Start (or share) the compile of a new request's grammar."""
        params = request.params.structured_outputs
        key = params.key()
        future = self._cache.get(key)
        if future is None:
            future = self._pool.submit(self._compile, params)
            self._cache[key] = future
            self.compiles += 1
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
            self.cache_hits += 1
        deadline = time.monotonic() + self.compile_timeout_s
        request.grammar = GrammarState(future, deadline, f"structured_outputs.{params.kind}")
        self._live[request.request_id] = request

    def _compile(self, params: StructuredOutputsParams):
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
        self._pool.shutdown(wait=False, cancel_futures=True)
