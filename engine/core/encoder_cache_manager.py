"""Scheduler-side bookkeeping of encoder outputs (vLLM v1 semantics).

Outputs are keyed by multimodal identifier and shared by every request that uses the
same image. Referenced entries stay; unreferenced ones remain cached (a later request may
hit) until space is needed, then they are evicted oldest-first. The runner drops evicted
outputs when told through ``take_freed``.
"""

from __future__ import annotations

from collections import OrderedDict


class EncoderCacheManager:
    def __init__(self, capacity_tokens: int):
        self.capacity = capacity_tokens
        self.num_free = capacity_tokens  # free slots, not counting evictable entries
        self.refs: dict[str, set[str]] = {}  # identifier -> request ids using it
        self.sizes: dict[str, int] = {}
        self.freeable: OrderedDict[str, int] = OrderedDict()  # unreferenced, oldest first
        self.freed: list[str] = []
        self.queries = 0
        self.hits = 0

    def check_and_update_cache(self, request_id: str, identifier: str) -> bool:
        """If ``identifier`` is cached, reference it for ``request_id`` and return True."""
        self.queries += 1
        if identifier not in self.refs:
            return False
        self.hits += 1
        self.freeable.pop(identifier, None)
        self.refs[identifier].add(request_id)
        return True

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether ``num_tokens`` fit, counting what evicting unreferenced entries would free."""
        return num_tokens <= self.num_free + sum(self.freeable.values())

    def allocate(self, request_id: str, identifier: str, num_tokens: int) -> None:
        """Reserve space for an output the runner is about to compute (evicts as needed)."""
        if num_tokens > self.num_free + sum(self.freeable.values()):
            raise ValueError(f"encoder cache: no room for {num_tokens} tokens")
        while self.num_free < num_tokens:
            old, size = self.freeable.popitem(last=False)
            del self.refs[old], self.sizes[old]
            self.num_free += size
            self.freed.append(old)
        self.num_free -= num_tokens
        self.refs[identifier] = {request_id}
        self.sizes[identifier] = num_tokens

    def free_encoder_input(self, request_id: str, identifier: str) -> None:
        """Drop ``request_id``'s reference; the entry stays cached until space is needed."""
        users = self.refs.get(identifier)
        if users is None or request_id not in users:
            return
        users.discard(request_id)
        if not users:
            self.freeable[identifier] = self.sizes[identifier]

    def free(self, request_id: str, identifiers: list[str]) -> None:
        for identifier in identifiers:
            self.free_encoder_input(request_id, identifier)

    def take_freed(self) -> list[str]:
        freed, self.freed = self.freed, []
        return freed
