"""Prefetching: items drawn by a background thread while the learner computes.

Finalizers never wait for a thread. An iterator dropped without ``close`` (or freed by the
cyclic garbage collector, which may run on any thread, also one holding the buffer's lock)
only tells its worker to stop; the worker then ends after its current draw. Joining there
could wait for a worker that waits for a lock held by the very thread running the collector.
``close`` joins, except on the worker's own thread. After ``os.fork`` the child's iterators
start new workers and queues: the parent's threads do not exist in the child, and their locks
may have been held at the fork.
"""

from __future__ import annotations

import atexit
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

from lucid_replay import forks

__all__: list[str] = []  # internal module

_Item = TypeVar("_Item")
_POLL_S = 0.05  # how often a worker with a full queue checks whether it should stop


class _Failure:
    """An error raised by the worker, carried to the consumer."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class Prefetcher(Generic[_Item]):
    """An endless iterator of ``draw()`` results made by a worker thread, ``depth`` ahead.

    The worker starts at the first ``next`` and stops at ``close`` (also on leaving a
    ``with`` block), at an error (raised in the consumer), or when the iterator is dropped.
    """

    def __init__(self, draw: Callable[[], _Item], depth: int) -> None:
        self._draw = draw
        self._depth = depth
        self._closed = False
        self._reset()
        forks.reset_in_child(self)

    def _reset(self) -> None:
        self._ready: queue.Queue[_Item | _Failure] = queue.Queue(maxsize=self._depth)
        self._stop = threading.Event()
        self._worker: threading.Thread | None = None

    def __iter__(self) -> Prefetcher[_Item]:
        return self

    def __next__(self) -> _Item:
        if self._closed:
            raise StopIteration
        if self._worker is None:
            self._start()
        item = self._ready.get()
        if isinstance(item, _Failure):
            self.close()
            raise item.error
        return item

    def _start(self) -> None:
        # The worker holds the draw, the queue and the event, never this iterator, so an
        # iterator nobody references can be collected while its worker runs.
        worker = threading.Thread(
            target=_produce,
            args=(self._draw, self._ready, self._stop),
            name="lucid_replay-prefetch",
            daemon=True,
        )
        worker.start()
        self._worker = worker
        _running[worker] = self._stop

    def close(self) -> None:
        """Stop the worker and wait for it (it finishes a draw in progress first)."""
        self._closed = True
        self._stop.set()
        worker = self._worker
        if worker is not None and worker is not threading.current_thread():
            worker.join()
            _running.pop(worker, None)

    def __enter__(self) -> Prefetcher[_Item]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        # May run inside the garbage collector on any thread: signal, never join.
        self._stop.set()

    def _after_fork(self) -> None:
        """In a forked child: forget the parent's worker and queue; the next draw restarts."""
        self._reset()


def _produce(
    draw: Callable[[], _Item], ready: queue.Queue[_Item | _Failure], stop: threading.Event
) -> None:
    def hand_over(item: _Item | _Failure) -> bool:
        # Never block for good on a full queue: the consumer may have gone away.
        while not stop.is_set():
            try:
                ready.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    try:
        while not stop.is_set() and hand_over(draw()):
            pass
    except BaseException as error:  # handed to the consumer, raised there
        hand_over(_Failure(error))


def recycling(draw_into: Callable[[_Item | None], _Item], slots: int) -> Callable[[], _Item]:
    """A draw into a ring of ``slots`` items: ``draw_into(previous item of the slot)``.

    With ``slots = depth + 2`` a `Prefetcher` never overwrites an item still in use: the
    worker fills item ``n`` while the consumer holds item ``n - depth - 1`` at the latest.
    """
    ring: list[_Item | None] = [None] * slots
    drawn = [0]

    def draw() -> _Item:
        slot = drawn[0] % slots
        item = draw_into(ring[slot])
        ring[slot], drawn[0] = item, drawn[0] + 1
        return item

    return draw


# Workers of iterators still running when the interpreter exits: a daemon thread killed in the
# middle of a torch operation aborts the process, so stop and join them first.
_running: weakref.WeakKeyDictionary[threading.Thread, threading.Event] = weakref.WeakKeyDictionary()


@atexit.register
def _stop_running_workers() -> None:
    # In a forked child the parent's threads are marked stopped: their joins return at once.
    for worker, stop in list(_running.items()):
        stop.set()
        worker.join(timeout=10)
