"""Admission control of one engine pod: a bound on the sequences it has accepted.

The pod runs up to ``max_running`` sequences at once (the engine's ``max_num_seqs``) and lets
``max_queued`` more wait. A request that would go past that is refused with 503 and
``Retry-After``, which the router reads as "this pod is busy" and takes to another pod.
Sequences, not HTTP requests, are counted (``n`` per prompt), since that is what the
scheduler queues. The count lives here, in the HTTP process, from the moment a request is
accepted to the end of its response: exact, with no lag behind the core's own stats.
"""

from __future__ import annotations

from epdserve.engine.entrypoints.openai.errors import APIError

RETRY_AFTER_S = 1  # a queue this long drains in about a batch's generation time


def default_max_queued(max_num_seqs: int) -> int:
    """4 x max_num_seqs: a full queue drains in about four generations of a full batch."""
    return 4 * max_num_seqs


class Admission:
    def __init__(self, max_running: int, max_queued: int, metrics=None):
        if max_queued < 0:
            raise ValueError(f"max_queued_requests: must be non-negative, got {max_queued}")
        self.limit = max_running + max_queued
        self.held = 0  # sequences of requests accepted and not yet answered
        self.metrics = metrics  # EngineMetrics or None

    def admit(self, num_seqs: int) -> None:
        """Count a request in, or raise 503 + Retry-After. A request larger than the whole
        bound is taken only by an empty pod (it could never be served otherwise)."""
        if self.held and self.held + num_seqs > self.limit:
            if self.metrics is not None:
                self.metrics.on_refused("queue_full")
            raise APIError(
                503,
                f"this pod is busy: {self.held} sequences accepted, at most {self.limit} "
                "(--max-num-seqs running plus --max-queued-requests waiting); retry later",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        self.held += num_seqs
        self._report()

    def release(self, num_seqs: int) -> None:
        """The request's response ended (answered, failed or its client left)."""
        self.held -= num_seqs
        assert self.held >= 0, f"admission count went negative ({self.held})"
        self._report()

    def _report(self) -> None:
        if self.metrics is not None:
            self.metrics.admitted.set(self.held)
