"""Runs store work on background threads so loads and saves overlap the model's compute."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from epdserve.connectors.storage.base import BlockStore

T = TypeVar("T")


class AsyncBlockStore:
    """A ``BlockStore`` plus its worker threads; each operation returns a ``Future``.

    With ``max_workers=1`` (the default) work runs in submission order, so a save submitted
    before a load of the same key is visible to it. Store operations never raise on backend
    faults, so futures fail only on programming errors. ``close()`` drains pending work.
    """

    def __init__(self, store: BlockStore, max_workers: int = 1, name: str = "epd-store"):
        self.store = store
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=name)

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
        """Run ``fn(*args, **kwargs)`` on a worker, e.g. ``submit(kv_io.load, cache, ids, hashes)``."""
        return self._pool.submit(fn, *args, **kwargs)

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> Future[list[bool]]:
        return self.submit(self.store.put_many, list(items))

    def get_many(self, keys: Sequence[str]) -> Future[list[bytes | None]]:
        return self.submit(self.store.get_many, list(keys))

    def exists_many(self, keys: Sequence[str]) -> Future[list[bool]]:
        return self.submit(self.store.exists_many, list(keys))

    def delete_many(self, keys: Sequence[str]) -> Future[int]:
        return self.submit(self.store.delete_many, list(keys))

    def close(self, close_store: bool = True) -> None:
        """Finish pending work, stop the workers, then close the store (unless told not to)."""
        self._pool.shutdown(wait=True)
        if close_store:
            self.store.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
