"""After ``os.fork``: objects that must reset themselves in the child, and the one hook.

A forked child has only the thread that forked. Locks held by the parent's other threads
(a prefetch worker in the middle of a draw) stay locked in the child for good, and the
child's random streams would repeat the parent's. Objects registered here get their
``_after_fork()`` called in every child, before the child's code runs on.
"""

from __future__ import annotations

import os
import weakref
from typing import Protocol

__all__: list[str] = []  # internal module


class _Resettable(Protocol):
    def _after_fork(self) -> None: ...


_registered: weakref.WeakSet[_Resettable] = weakref.WeakSet()


def reset_in_child(instance: _Resettable) -> None:
    """Call ``instance._after_fork()`` in every child forked while it is alive."""
    _registered.add(instance)


def _reset_registered() -> None:
    for instance in list(_registered):
        instance._after_fork()


if hasattr(os, "register_at_fork"):  # not on Windows, which cannot fork
    os.register_at_fork(after_in_child=_reset_registered)
