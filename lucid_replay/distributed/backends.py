"""Backends: the same shard and control objects, in-process or as Ray actors.

Callers speak Ray's dialect to both (`lucid_replay.distributed.calls`). Ray is imported only
for ``backend="ray"``.
"""

from __future__ import annotations

import contextlib
import shutil
import uuid
from typing import Any

import lucid_replay.distributed.lanes as lanes
import lucid_replay.distributed.settings as settings
import lucid_replay.distributed.sharing as sharing
from lucid_replay.distributed.calls import BACKENDS, LocalHandle, get
from lucid_replay.distributed.control import Control
from lucid_replay.distributed.shards import ReplayShard
from lucid_replay.errors import CheckpointError, InvalidTypeError, must

__all__: list[str] = []  # internal module

# Ray re-runs a dead shard's constructor (which reloads its checkpoint) without limit; a call
# in flight when it died raises to its caller (at most once: adds are never applied twice).
# The control is threaded, so that a call waiting on the rate limiter blocks no other call.
# A Ray shard also answers lanes (`lanes`) from threads of its own: its calls take one lock.
SerialReplayShard = lanes.serialized(ReplayShard, __name__)


def check_backend(backend: object) -> str:
    """Refuse an unknown ``backend``; for ``"ray"``, refuse when Ray is not usable."""
    if backend not in BACKENDS:
        raise must("backend", f"one of {BACKENDS}", backend)
    if backend == "ray":
        try:
            import ray
        except ImportError:
            raise ImportError(
                'backend="ray" needs Ray: pip install "lucid-replay[distributed]"'
            ) from None
        if not ray.is_initialized():
            # A single-node default; call ray.init yourself to join a cluster.
            ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    return str(backend)


def make_control(backend: str, name: str, *args: Any) -> Any:
    """A `Control` for ``backend`` (a handle either way); a Ray actor is named ``name``."""
    if backend == "local":
        return LocalHandle(Control(*args))
    import ray

    options = {"max_concurrency": 64, "num_cpus": 0, "name": name}
    return ray.remote(Control).options(**options).remote(*args)


def make_shard(backend: str, index: int, shard: dict[str, Any], control: Any, **kw: Any) -> Any:
    """A `ReplayShard` for ``backend`` (a handle either way), not opened yet.

    A Ray shard gets the name of its control, which it looks up: an actor handle among the
    constructor arguments of a restartable actor would live in the object store, which Ray
    warns against (the arguments must outlive every restart).
    """
    if backend == "local":
        return LocalHandle(ReplayShard(index, shard, control, restarted=False, **kw))
    import ray

    actor: Any = ray.remote(max_restarts=-1, max_task_retries=0, num_cpus=0)(SerialReplayShard)
    return actor.remote(index, shard, control, **kw)


def start(
    config: dict[str, Any], saved: dict[str, Any] | None, paths: list[str] | None
) -> tuple[list[Any], Any, str]:
    """The shards and control of ``config``, restored from shard files ``paths`` if given.

    Also returns the directory under which ``storage="memory"`` shards share their fields
    (``transport="shared"`` or ``"auto"``; the client removes it when it closes).

    Every shard opens (loads its file) before any writes its first restart file, so a load
    that a shard refuses writes nothing. On any failure every actor started here is stopped
    again; a shard's failure to load its file is a `CheckpointError` on both backends.
    """
    backend = check_backend(config["backend"])
    limiter = settings.limiter_from(config["rate_limiter"])
    replay = uuid.uuid4().hex
    root = sharing.shared_root(replay)
    started: list[Any] = []
    try:
        control = make_control(
            backend, f"lucid_replay-control-{replay}", config["num_shards"], limiter
        )
        started.append(control)
        if saved is not None:
            get(control.restore.remote(saved["control"]))
        if config.get("schema") is not None:  # declared: every shard stores it from the start
            get(control.propose_schema.remote(config["schema"]))
        reference = control if backend == "local" else f"lucid_replay-control-{replay}"
        shards = []
        for k in range(config["num_shards"]):
            shard = settings.shard_settings(config, k, replay, root)
            restore = None if paths is None else paths[k]
            shards.append(make_shard(backend, k, shard, reference, restore_path=restore))
            started.append(shards[-1])
        futures = [s.open.remote() for s in shards]
        for k, future in enumerate(futures):
            _opened(k, future, None if paths is None else paths[k])
        get([s.first_checkpoint.remote() for s in shards])
    except BaseException:
        for handle in reversed(started):
            kill(handle)
        shutil.rmtree(root, ignore_errors=True)
        raise
    return shards, control, root


def _opened(index: int, future: Any, path: str | None) -> None:
    """Wait for shard ``index`` to open; its loading failure as a `CheckpointError`.

    On Ray the shard's own `CheckpointError` comes back wrapped (a Ray error that is also a
    `CheckpointError`), and a shard whose process died while loading is an actor error:
    both become a plain `CheckpointError` naming the file.
    """
    try:
        get(future)
    except CheckpointError as error:
        raise CheckpointError(str(getattr(error, "cause", error))) from None
    except Exception as error:
        if path is None or not _actor_died(error):
            raise
        lines = str(error).strip().splitlines() or [type(error).__name__]
        raise CheckpointError(
            f"shard {index} must load its file {path!r}, got its actor dead "
            f"({type(error).__name__}: {lines[-1]})"
        ) from error


def _actor_died(error: Exception) -> bool:
    """Whether ``error`` is Ray's for an actor that died (only Ray raises those)."""
    if type(error).__module__.split(".")[0] != "ray":
        return False
    import ray

    return isinstance(error, ray.exceptions.RayActorError)


def pickled(backend: str, state: dict[str, Any]) -> dict[str, Any]:
    """A client's state to pickle: handles and configuration, not its lock or generator."""
    if backend == "local":
        raise InvalidTypeError(
            'a ShardedReplay with backend="local" cannot be pickled: its shards live in '
            'this process (use backend="ray" to add from other processes)'
        )
    dropped = (
        "_lock",
        "_mapped",
        "_resolved",
        "_transport_stats",
        "_blocks",
        "_lanes",
        "_lane_handles",
        "_cleanup",
    )
    return {k: v for k, v in state.items() if k not in dropped}


def node_of(handle: Any) -> str | None:
    """The Ray node id of an actor (``None`` in-process: the client's node)."""
    if isinstance(handle, LocalHandle):
        return None
    return str(get(handle.node.remote()))


def client_node(backend: str) -> str | None:
    """The Ray node id of the calling process (``None`` with ``backend="local"``)."""
    if backend == "local":
        return None
    import ray

    return str(ray.get_runtime_context().get_node_id())


def kill(handle: Any) -> None:
    """End an actor for good (``close``, a failed start); nothing for an in-process object."""
    if isinstance(handle, LocalHandle):
        return
    import ray

    with contextlib.suppress(Exception):  # already dead
        ray.kill(handle, no_restart=True)
