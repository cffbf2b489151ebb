"""Which version of each adapter a pod serves: the digest of the adapter's files that our
pods send with an adapter's blocks (``lora_digest``). A request for the adapter is keyed for
that pod with it, as the pod keys its blocks; a vLLM pod sends none (keyed by name alone)."""

from __future__ import annotations

from collections import OrderedDict

MAX_ADAPTERS_PER_POD = 1024  # digests remembered per pod (a pod's registry's bound)


class AdapterVersions:
    """Per pod, adapter name -> the digest in its latest stored block (bounded, LRU)."""

    def __init__(self) -> None:
        self._pods: dict[str, OrderedDict[str, str]] = {}

    def get(self, pod: str, lora_name: str) -> str | None:
        digests = self._pods.get(pod)
        return digests.get(lora_name) if digests else None

    def note(self, pod: str, lora_name: str | None, digest: str | None) -> None:
        """A block of ``lora_name`` stored by ``pod`` under ``digest`` (the pod's version now)."""
        if not (lora_name and digest):
            return
        digests = self._pods.setdefault(pod, OrderedDict())
        digests[lora_name] = digest
        digests.move_to_end(lora_name)
        while len(digests) > MAX_ADAPTERS_PER_POD:
            digests.popitem(last=False)

    def forget(self, pod: str) -> None:
        self._pods.pop(pod, None)
