"""Lanes: a client's calls to a Ray shard on its own node over a Unix socket, not Ray's RPC.

With ``transport="shared"`` the batch's bytes no longer travel with a draw's reply, so a
draw costs what its calls cost, and a Ray actor call costs about 1 ms of the client's CPU
and 1-2 ms of latency on a 2-core node. A lane is one connection from a client to a shard
process: a call is one pickled ``(method, args, kwargs)`` and one pickled reply, about
0.1 ms each way. The shard answers a lane in a thread of its own (`LaneServer`), so its
class is `serialized`: every public method, whether Ray's thread or a lane calls it, runs
under one lock, one call at a time, as Ray alone would run them.

A shard runs one caller's calls in the order they were sent (what a stream's exact law
rests on, `lucid_replay.distributed.stream`). A client sends its draws on lanes and its
other calls through Ray, so before any other call it reads the replies of the draws it has
in flight (`Lane.settle`): the shard has run them, and the next call comes after them.

A lane that breaks (the shard's process died) fails its calls in flight with Ray's
`RayActorError`, as Ray fails calls in flight to a dead actor, and the client opens a new
lane, to the restarted shard, on its next draw.
"""

from __future__ import annotations

import collections
import functools
import inspect
import os
import pickle
import threading
import uuid
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

__all__: list[str] = []  # internal module

_FAMILY = "AF_UNIX"


# ------------------------------------------------------------------------- shard side
def serialized(cls: type, module: str) -> type:
    """A subclass of ``cls`` whose public methods run one at a time, under one lock.

    It is named ``Serial<cls>`` and must be bound to that name in ``module``: Ray pickles an
    actor's class by reference where it can.

    Ray runs an actor's calls in one thread; a `LaneServer` calls the same methods from its
    own threads: the lock keeps every call whole, in the order the lock is taken.
    """
    wrapped: dict[str, Any] = {}
    for name, function in inspect.getmembers(cls, inspect.isfunction):
        # Instance methods only: a static method has no ``self`` to hold the lock.
        if not name.startswith("_") and inspect.isfunction(inspect.getattr_static(cls, name)):
            wrapped[name] = _locked(function)
    original_init = cls.__init__  # type: ignore[misc]

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        self._serial = threading.RLock()
        original_init(self, *args, **kwargs)

    wrapped["__init__"] = functools.wraps(original_init)(__init__)
    name = f"Serial{cls.__name__}"
    wrapped["__qualname__"], wrapped["__module__"] = name, module
    return type(name, (cls,), wrapped)


def _locked(function: Any) -> Any:
    @functools.wraps(function)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._serial:
            return function(self, *args, **kwargs)

    return call


class LaneServer:
    """A shard process's listener: one thread per client connection, calls run in order."""

    def __init__(self, target: Any) -> None:
        self.target = target
        self.key = os.urandom(32)
        # An abstract socket (Linux): no file to clean up, no path length limit.
        self.address = f"\0lucid_replay-lane-{uuid.uuid4().hex}"
        self._listener = Listener(self.address, family=_FAMILY, authkey=self.key)
        threading.Thread(target=self._accept, name="lucid_replay-lanes", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                connection = self._listener.accept()
            except (AuthenticationError, EOFError, OSError):  # a failed handshake
                continue
            threading.Thread(target=self._serve, args=(connection,), daemon=True).start()

    def _serve(self, connection: Connection) -> None:
        with connection:
            while True:
                try:
                    name, args, kwargs = pickle.loads(connection.recv_bytes())
                except (EOFError, OSError):  # the client closed its lane
                    return
                try:
                    if name.startswith("_"):
                        raise AttributeError(f"a lane calls public methods, got {name!r}")
                    reply = (True, getattr(self.target, name)(*args, **kwargs))
                except Exception as error:  # handed to the caller, as Ray does
                    reply = (False, error)
                try:
                    payload = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
                except Exception as error:  # an unpicklable value or error
                    text = f"{type(error).__name__}: {error}"
                    payload = pickle.dumps((False, RuntimeError(f"{name}: {text}")))
                try:
                    connection.send_bytes(payload)
                except OSError:
                    return


# ------------------------------------------------------------------------ client side
class LaneFuture:
    """A call sent on a lane; its reply is read by `Lane.settle` (or `calls.get`)."""

    __slots__ = ("done", "error", "lane", "value")

    def __init__(self, lane: Lane) -> None:
        self.lane = lane
        self.done = False
        self.value: Any = None
        self.error: BaseException | None = None

    def result(self) -> Any:
        """The reply (waiting for it); the shard's error is raised here."""
        if not self.done:
            self.lane.settle(self)
        if self.error is not None:
            raise self.error
        return self.value


class Lane:
    """One client's connection to one shard process."""

    def __init__(self, address: str, key: bytes) -> None:
        self._connection: Connection | None = Client(address, family=_FAMILY, authkey=key)
        self._lock = threading.Lock()
        self._waiting: collections.deque[LaneFuture] = collections.deque()
        self._pid = os.getpid()  # a forked child must not read its parent's replies

    @property
    def usable(self) -> bool:
        """Open, and this process's own."""
        return self._connection is not None and self._pid == os.getpid()

    def call(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> LaneFuture:
        """Send a call; its reply is read later, in order."""
        payload = pickle.dumps((name, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            future = LaneFuture(self)
            if self._connection is None:
                future.done, future.error = True, _lost("closed")
                return future
            try:
                self._connection.send_bytes(payload)
            except OSError as error:
                self._break(error)
                future.done, future.error = True, _lost(error)
                return future
            self._waiting.append(future)
            return future

    def settle(self, until: LaneFuture | None = None) -> None:
        """Read replies in order until ``until``'s is in (every reply in flight: ``None``)."""
        with self._lock:
            while self._waiting and (until is None or not until.done):
                future = self._waiting[0]
                try:
                    assert self._connection is not None
                    ok, value = pickle.loads(self._connection.recv_bytes())
                except (EOFError, OSError) as error:
                    self._break(error)
                    return
                self._waiting.popleft()
                future.done = True
                if ok:
                    future.value = value
                else:
                    future.error = value

    def _break(self, cause: BaseException | str) -> None:
        """The shard is gone: every call in flight fails as Ray fails calls to a dead actor."""
        for future in self._waiting:
            future.done, future.error = True, _lost(cause)
        self._waiting.clear()
        self.close()

    def close(self) -> None:
        """Close the connection (the shard's thread for it ends)."""
        connection, self._connection = self._connection, None
        if connection is not None and self._pid == os.getpid():
            connection.close()


class _LaneMethod:
    __slots__ = ("_lane", "_name")

    def __init__(self, lane: Lane, name: str) -> None:
        self._lane, self._name = lane, name

    def remote(self, *args: Any, **kwargs: Any) -> LaneFuture:
        return self._lane.call(self._name, args, kwargs)


class LaneHandle:
    """A shard's calls on a lane, in the dialect of a Ray actor handle."""

    def __init__(self, lane: Lane) -> None:
        self.lane = lane

    def __getattr__(self, name: str) -> _LaneMethod:
        return _LaneMethod(self.lane, name)


def _lost(cause: BaseException | str) -> BaseException:
    import ray

    return ray.exceptions.RayActorError(
        error_msg=f"the shard's process ended while a call on its lane was in flight ({cause})"
    )
