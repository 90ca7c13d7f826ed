"""A background thread that keeps the next few batches ready while the net computes.

The thread only runs an iterator the caller built, in order, and hands its items over through a
bounded queue. The sequence of items is therefore the iterator's sequence, whatever the thread's
timing; determinism is the iterator's business (see `data.batches`).
"""
from __future__ import annotations

import queue
import threading
from typing import Generic, Iterator, TypeVar

T = TypeVar("T")

_POLL_S = 0.1  # how often a blocked worker or reader checks whether it should give up


class _Failure:
    """An exception raised by the iterator, carried to the consumer's thread."""

    def __init__(self, exc: BaseException):
        self.exc = exc


class Prefetcher(Generic[T]):
    def __init__(self, items: Iterator[T], depth: int, name: str = "prefetch"):
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._failure: _Failure | None = None
        # A daemon: a run that ends without closing its layers must still be able to exit.
        self._thread = threading.Thread(target=self._work, args=(items,), name=name, daemon=True)
        self._thread.start()

    def _work(self, items: Iterator[T]) -> None:
        try:
            for item in items:
                if not self._put(item):
                    break
        except BaseException as e:  # noqa: BLE001 - every failure must reach the consumer, not vanish here
            self._put(_Failure(e))
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()  # a generator's cleanup (an open read transaction) runs in the thread that used it

    def _put(self, item: object) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def next(self) -> T:
        """The next item, waiting for it if needed; re-raises the iterator's exception."""
        if self._failure is not None:
            raise self._failure.exc
        while True:
            try:
                item = self._queue.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("the prefetch thread stopped without producing an item")
        if isinstance(item, _Failure):
            self._failure = item
            raise item.exc
        return item

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread and wait for it; items not taken are dropped."""
        self._stop.set()
        while True:  # drained so a worker blocked in put() wakes up at once
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()
