"""Cache updates that run in the background while the next chunk computes.

An update is submitted per slot (one slot per block chunk) and awaited only when that slot's
cache is needed again. A failed or stuck update is raised in the caller as `CacheUpdateError`,
never a hang.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable

from ..errors import LlamaANEError

CACHE_UPDATE_TIMEOUT_S = 120.0


class CacheUpdateError(LlamaANEError, RuntimeError):
    """The asynchronous cache-update model failed or did not finish."""


class AsyncUpdates:
    """One worker thread; `submit(slot, fn)` runs fn in the background, `wait(slot)` joins it."""

    def __init__(self, names: list[str], timeout_s: float = CACHE_UPDATE_TIMEOUT_S):
        self.names = names
        self.timeout_s = timeout_s
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cache-update")
        self._pending: dict[int, Future] = {}

    def submit(self, slot: int, fn: Callable[[], None]) -> None:
        self.wait(slot)
        self._pending[slot] = self._executor.submit(fn)

    def wait(self, slot: int) -> None:
        fut = self._pending.pop(slot, None)
        if fut is None:
            return
        try:
            fut.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise CacheUpdateError(f"cache update of {self.names[slot]} did not finish in {self.timeout_s:.0f} s") from None
        except Exception as e:
            raise CacheUpdateError(f"cache update of {self.names[slot]} failed: {e}") from e

    def discard(self) -> None:
        """Join every pending update, dropping its result or error: the caches are being thrown away."""
        for slot in list(self._pending):
            try:
                self.wait(slot)
            except CacheUpdateError:
                pass

    def wait_all(self) -> None:
        for slot in list(self._pending):
            self.wait(slot)

    def close(self) -> None:
        try:
            self.wait_all()
        finally:
            self._executor.shutdown(wait=True)
