"""Prefetching: windows drawn by a background thread while the learner computes."""

from __future__ import annotations

import atexit
import queue
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import TypeVar

__all__: list[str] = []  # internal module

_Item = TypeVar("_Item")


class _Failure:
    """An error raised by the worker, carried to the consumer."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


def iterate_in_background(draw: Callable[[], _Item], depth: int) -> Iterator[_Item]:
    """Yield ``draw()`` results made by a worker thread, at most ``depth`` ahead.

    A generator, so the worker starts at the first ``next`` and stops (joined) when the
    generator is closed, exhausted by an error, or garbage collected.
    """
    ready: queue.Queue[_Item | _Failure] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def hand_over(item: _Item | _Failure) -> bool:
        # Never block for good on a full queue: the consumer may have gone away.
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            while hand_over(draw()):
                pass
        except BaseException as error:  # handed to the consumer, raised there
            hand_over(_Failure(error))

    worker = threading.Thread(target=produce, name="lucid_replay-prefetch", daemon=True)
    worker.start()
    _running_workers[worker] = stop
    try:
        while True:
            item = ready.get()
            if isinstance(item, _Failure):
                raise item.error
            yield item
    finally:
        stop.set()
        worker.join()
        _running_workers.pop(worker, None)


# Workers of iterators still referenced when the interpreter exits: a daemon thread killed in
# the middle of a torch operation aborts the process, so stop and join them first.
_running_workers: weakref.WeakKeyDictionary[threading.Thread, threading.Event] = (
    weakref.WeakKeyDictionary()
)


@atexit.register
def _stop_running_workers() -> None:
    for worker, stop in list(_running_workers.items()):
        stop.set()
        worker.join(timeout=10)
