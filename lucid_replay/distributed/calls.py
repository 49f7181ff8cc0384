"""Calls in Ray's dialect, for in-process objects too: ``handle.method.remote(...)`` and `get`.

``backend="local"`` wraps objects in `LocalHandle`, whose calls run at once, in order, and
keep their result (or error) for `get`, so shards, the control and the client run the same
code on both backends. A `LaneFuture` is a call sent on a lane
(`lucid_replay.distributed.lanes`). Ray is imported only when a future is one of Ray's.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from lucid_replay.distributed.lanes import LaneFuture

__all__: list[str] = []  # internal module

BACKENDS = ("ray", "local")


class LocalFuture:
    """The outcome of a call already made: a value or an error, raised by `get`."""

    __slots__ = ("error", "value")

    def __init__(self, value: Any = None, error: BaseException | None = None) -> None:
        self.value, self.error = value, error


class _LocalMethod:
    __slots__ = ("_function",)

    def __init__(self, function: Callable[..., Any]) -> None:
        self._function = function

    def remote(self, *args: Any, **kwargs: Any) -> LocalFuture:
        try:
            return LocalFuture(self._function(*args, **kwargs))
        except Exception as error:  # handed to `get`, as Ray does
            return LocalFuture(error=error)


class LocalHandle:
    """An in-process object behind the calling convention of a Ray actor handle."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def __getattr__(self, name: str) -> _LocalMethod:
        return _LocalMethod(getattr(self.target, name))


def get(futures: Any) -> Any:
    """Wait for one future or a list of them (local, lane or Ray); raise the first error."""
    if isinstance(futures, list):
        if all(isinstance(f, LocalFuture) for f in futures):
            return [_result(f) for f in futures]
        if any(isinstance(f, LaneFuture) for f in futures):
            return [get(f) for f in futures]
        import ray

        return ray.get(futures)
    if isinstance(futures, LocalFuture):
        return _result(futures)
    if isinstance(futures, LaneFuture):
        return futures.result()
    import ray

    return ray.get(futures)


def _result(future: LocalFuture) -> Any:
    if future.error is not None:
        raise future.error
    return future.value


def restarted_actor() -> bool:
    """Inside a Ray actor's constructor: whether Ray is restarting it after a death."""
    import ray

    return bool(ray.get_runtime_context().was_current_actor_reconstructed)


def process_id() -> int:
    """The id of the calling process (what a shard reports, so tests see where it runs)."""
    return os.getpid()


def named_actor(name: str) -> Any:
    """The Ray actor named ``name``."""
    import ray

    return ray.get_actor(name)
