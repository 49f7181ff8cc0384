"""`ShardedReplay`: one prioritized sequence replay over several shards, in-process or on Ray."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, cast

import numpy as np
import torch

import lucid_replay.distributed.backends as backends
import lucid_replay.distributed.calls as calls
import lucid_replay.distributed.checkpoints as checkpoints
import lucid_replay.distributed.coordination as coordination
import lucid_replay.distributed.draw as draw
import lucid_replay.distributed.options as options
import lucid_replay.distributed.routing as routing
import lucid_replay.distributed.settings as settings
from lucid_replay.batch import Batch, PrioritizedBatch, WindowBatch
from lucid_replay.blocks import CACHE_BYTES
from lucid_replay.checks import check_device, check_prefetch
from lucid_replay.distributed.client_state import ClientState
from lucid_replay.distributed.client_transport import ClientTransport
from lucid_replay.distributed.control import summary
from lucid_replay.distributed.episode_streams import ShardedStreams
from lucid_replay.distributed.lifecycle import ClientLife, ClientPriorities
from lucid_replay.distributed.limiter import RateLimiterConfig
from lucid_replay.distributed.reports import ClientReports
from lucid_replay.distributed.stream import BatchStream
from lucid_replay.episode import Episode
from lucid_replay.fields import Field
from lucid_replay.laws import Uniform
from lucid_replay.selectors import AnySelector
from lucid_replay.window import Window

__all__ = ["ShardedReplay"]


class ShardedReplay(ClientLife, ClientPriorities, ClientReports, ClientTransport, ShardedStreams):
    r"""A prioritized sequence replay split over shards, drawing exactly what one buffer would.

    Build it with `create` (or `load`). Each shard is a `PrioritizedSequenceReplay` of
    ``capacity // num_shards`` transitions (the remainder is dropped), as a Ray actor
    (``backend="ray"``) or in this process (``backend="local"``, same code and semantics).
    The client offers the single buffer's methods; its batches are the core's `Batch`,
    `PrioritizedBatch` and `WindowBatch`, with *global* episode ids.

    Notes
    -----
    A draw reads every shard's total mass $Z_k$, labels the batch positions with shards
    (shard ``k`` with probability $Z_k / Z$), lets each shard draw its count from its own
    tree and puts the draws back at their positions: the single buffer's law over all
    stored episodes, and weights $(\min p / p)^{\alpha\beta}$ normalised over the whole
    batch (the guide "Scaling out" derives it). ``selector=`` draws by `Uniform`,
    `Prioritized`, `Recency` or a `Mixture` of them with the same exact law over every
    shard (`Recency`'s age counts the transitions added to every shard), and
    ``batch.probabilities`` is each anchor's global probability
    (`lucid_replay.distributed.draw`). Episode ids pack the shard, its incarnation and the
    shard's own id (`lucid_replay.distributed.ids`), so they never repeat, also across
    shard restarts.

    With ``segment_length``, `open_episode` streams an episode onto one shard, chosen
    round robin when it is opened (`lucid_replay.distributed.episode_streams`); batches
    then carry global ``segment_ids``, encoded as episode ids are.

    A Ray client pickles: tasks and actors on any node `add` through their copy (and
    `EpisodeWriter` takes it as its buffer). A copy draws its own shard labels.

    Examples
    --------
    >>> import torch
    >>> from lucid_replay import Episode, Window
    >>> replay = ShardedReplay.create(2, 1000, seed=0, backend="local")
    >>> episodes = [Episode({"obs": torch.arange(10.0)}) for _ in range(3)]
    >>> ids = replay.extend(episodes)
    >>> [i >> 55 for i in ids]  # round robin over the shards
    [0, 1, 0]
    >>> batch = replay.sample_windows(4, Window(3, burn_in=1))
    >>> tuple(batch["obs"].shape), float(batch.weights.max())
    ((4, 4), 1.0)
    >>> replay.update_priorities(batch.episode_ids, [1.0, 2.0, 3.0, 4.0]) >= 1
    True
    >>> replay.close()
    """

    def __init__(
        self, config: dict[str, Any], shards: list[Any], control: Any, root: str | None = None
    ) -> None:
        """Use `create` or `load`; the constructor adopts shards already made."""
        self._config = config
        self._shards = shards
        self._control = control
        rng = np.random.default_rng(settings.coordinator_seed(config["seed"]))
        self._state = ClientState(rng, float(config["beta"]), len(shards))
        self._law = options.law_of(config)
        self._closed = False
        self._lock = threading.RLock()
        self._init_transport(root)

    # --------------------------------------------------------------------- construction
    @classmethod
    def create(
        cls,
        num_shards: int,
        capacity: int,
        *,
        alpha: float = 0.6,
        beta: float = 0.4,
        epsilon: float = 1e-6,
        unit: str = "chunk",
        seed: int | None = None,
        max_times_sampled: int | None = None,
        rate_limiter: RateLimiterConfig | None = None,
        backend: str = "ray",
        checkpoint_dir: str | os.PathLike[str] | None = None,
        checkpoint_every: int | None = None,
        segment_length: int | None = None,
        priority_unit: str = "episode",
        selector: AnySelector | None = None,
        schema: Mapping[str, tuple[tuple[int, ...], torch.dtype] | Field] | None = None,
        storage: str = "memory",
        directory: str | os.PathLike[str] | None = None,
        cache_bytes: int = CACHE_BYTES,
        transport: str = "auto",
        torn: str = "redraw",
    ) -> ShardedReplay:
        """Start ``num_shards`` shards of ``capacity // num_shards`` transitions each.

        Every argument is checked before any shard starts.

        Parameters
        ----------
        num_shards
            Number of shards, 1 to 256.
        capacity
            Transitions all shards hold together (each holds ``capacity // num_shards``).
        alpha, beta, epsilon, unit, max_times_sampled
            As `PrioritizedSequenceReplay`; the reuse limit is enforced over every shard.
        seed
            Makes draws reproducible (``backend="local"``, or Ray without concurrent callers).
            With one shard, draws equal a `PrioritizedSequenceReplay` seeded alike, draw for draw.
        rate_limiter
            `SampleToInsertRatio`, `MinSize` or ``None``: inserts are counted in transitions,
            samples in chunks or windows; both sides wait, up to their call's ``timeout``.
        backend
            ``"ray"`` (shard actors; calls `ray.init` if Ray is not running) or ``"local"``.
        checkpoint_dir
            Where shards write their restart files (``restart_<k>.lucid``, once as they start,
            then as ``checkpoint_every`` says) and where a restarted shard reloads its own.
            Restart files never replace the files a `save` into the same directory binds.
        checkpoint_every
            Each shard writes its restart file after every ``checkpoint_every`` episodes it
            stored (``None``: only when `save` writes into ``checkpoint_dir``); a streamed
            episode counts when it is closed.
        segment_length, priority_unit
            As `PrioritizedSequenceReplay`, for every shard (``1 <= segment_length <=``
            a shard's capacity): episodes are stored in segments and can be streamed
            (`open_episode`), each onto one shard. ``priority_unit="segment"`` keys
            priorities by global segment id (batch ``segment_ids``, `update_priorities`).
        selector
            As `PrioritizedSequenceReplay`: ``None`` (`Prioritized`), `Uniform`,
            `Prioritized`, `Recency` or a `Mixture` of them, with the single buffer's law
            over every shard and ``batch.probabilities`` the exact global ``P``. A
            `Prioritized` that carries its own alpha must carry ``alpha``. `Recency`'s age
            counts the transitions committed on every shard after the anchor's episode
            (segment), in the order the commits reach the replay's control (an `extend`
            over several shards as one commit, its episodes in order).
        schema, cache_bytes
            As `SequenceReplay` (`Field` stacks and codecs included), for every shard.
        storage, directory
            As `SequenceReplay`: ``"memmap"`` keeps shard ``k``'s fields under
            ``directory/shard_<k>`` (``directory`` new or empty). A restarted shard clears
            its directory and reloads its restart file into fresh files.
        transport
            How window batches reach the client (chunk draws always come as objects):
            ``"object"`` (each shard gathers its draws, which travel through Ray's object
            store and are merged here), ``"shared"`` (shards keep their fields in shared
            files, under ``/dev/shm`` or the memmap ``directory``, which the client maps
            read-only and gathers from itself: each byte of a batch copied once; client and
            shards on one node; no compressed fields), or ``"auto"``: ``"shared"`` where
            possible, else ``"object"``. See `transport_stats`.
        torn
            With ``"shared"``: what becomes of a window whose records were evicted or
            overwritten while the client copied them: ``"redraw"`` (drawn again by the same
            law) or ``"invalid"`` (returned with every record invalid). Counted either way.

        Raises
        ------
        InvalidArgumentError
            For a value out of range (``capacity < num_shards``, an unknown ``unit`` or
            ``backend``, ``checkpoint_every`` without ``checkpoint_dir``, a
            ``segment_length`` beyond a shard's capacity, ``priority_unit="segment"``
            without ``segment_length`` or with ``unit="episode"``, a ``Prioritized``
            selector of another alpha, ``directory`` with ``storage="memory"``, a memmap
            ``directory`` that is not new or empty, ...).
        TypeError
            For a ``rate_limiter`` or ``selector`` of another type, a bad ``schema``, or a
            non-integer count.

        Returns
        -------
        ShardedReplay
            The client (the learner's; pickle it to add from other processes).

        Examples
        --------
        >>> import torch
        >>> from lucid_replay import Episode, Mixture, Prioritized, Uniform, Window
        >>> mixture = Mixture({Prioritized(): 0.5, Uniform(): 0.5})
        >>> local = {"seed": 0, "backend": "local"}
        >>> replay = ShardedReplay.create(2, 1000, selector=mixture, **local)
        >>> ids = replay.extend(Episode({"obs": torch.zeros(n)}) for n in (3, 5))
        >>> replay.update_priorities([ids[1]], [3.0])  # 3 anchors of Window(3)
        1
        >>> batch = replay.sample_windows(4, Window(3))  # (3**0.6 / Z + 1/4) / 2
        >>> batch.probabilities.round(decimals=4).tolist()
        [0.2672, 0.2672, 0.2672, 0.2672]
        >>> replay.close()
        """
        config = settings.checked(
            num_shards=num_shards,
            capacity=capacity,
            alpha=alpha,
            beta=beta,
            epsilon=epsilon,
            unit=unit,
            seed=seed,
            max_times_sampled=max_times_sampled,
            rate_limiter=rate_limiter,
            backend=backend,
            checkpoint_dir=checkpoint_dir,
            checkpoint_every=checkpoint_every,
            segment_length=segment_length,
            priority_unit=priority_unit,
            selector=selector,
            schema=schema,
            storage=storage,
            directory=directory,
            cache_bytes=cache_bytes,
            transport=transport,
            torn=torn,
        )
        return cls._start(config, None, None)

    @classmethod
    def _start(
        cls, config: dict[str, Any], saved: dict[str, Any] | None, paths: list[str] | None
    ) -> ShardedReplay:
        options.claim_check(config["directory"])
        shards, control, root = backends.start(config, saved, paths)
        return cls(config, shards, control, root)

    @classmethod
    def load(
        cls,
        directory: str | os.PathLike[str],
        *,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        checkpoint_every: int | None = None,
        storage_directory: str | os.PathLike[str] | None = None,
    ) -> ShardedReplay:
        """Restart a replay written by `save`, with its backend and configuration.

        Later draws and ids equal those the saved replay would have made. Everything is
        checked before any shard starts (the manifest's entries, every shard file's size,
        SHA-256 and index) and every shard loads its file before any writes: a refused load
        starts nothing and writes nothing.

        Parameters
        ----------
        directory
            What `save` wrote into.
        checkpoint_dir, checkpoint_every
            Where the loaded replay writes its restart files, as in `create`. Both default to
            ``None``: a loaded replay writes no restart files, whatever the saved replay's
            ``checkpoint_dir`` was (that replay may still be running and using it); pass the
            saved directory again to continue a run that stopped. Without one, a restarted
            shard reloads its file in ``directory`` while a later save has not replaced it.
        storage_directory
            For a replay saved with ``storage="memmap"``: where the loaded shards keep their
            files (``storage_directory/shard_<k>``; new or empty). ``None``: the saved
            replay's ``directory``, which must be empty by then.

        Raises
        ------
        CheckpointError
            For a directory without a readable, consistent manifest, with a shard file that
            is missing, not the one the manifest binds, or another shard's, or that a shard
            cannot load (on Ray too: the actors started are stopped again).
        InvalidArgumentError, TypeError
            For ``checkpoint_dir`` and ``checkpoint_every`` as `create` refuses them.
        FileNotFoundError
            If ``directory`` has no manifest.
        """
        restart_dir, every = settings.checked_checkpoints(checkpoint_dir, checkpoint_every)
        manifest = checkpoints.read_manifest(directory)
        paths = checkpoints.bound_files(directory, manifest)
        config = {**manifest["config"], "checkpoint_dir": restart_dir, "checkpoint_every": every}
        config["directory"] = options.checked_storage_directory(config, storage_directory)
        replay = cls._start(config, manifest, paths)
        checkpoints.adopt(replay, manifest)
        return replay

    # ----------------------------------------------------------------------- properties
    num_shards = settings.config_property("num_shards", "Number of shards.")
    backend = settings.config_property("backend", '``"ray"`` or ``"local"``.')
    shard_capacity = settings.config_property("shard_capacity", "Transitions per shard.")
    alpha = settings.config_property("alpha", "Prioritization exponent.")
    epsilon = settings.config_property("epsilon", "Added to every ``|error|``.")
    unit = settings.config_property("unit", '``"chunk"`` or ``"episode"``.')
    max_times_sampled = settings.config_property("max_times_sampled", "The reuse limit.")

    @property
    def capacity(self) -> int:
        """Transitions all shards hold together: ``num_shards * shard_capacity``."""
        return int(self._config["num_shards"] * self._config["shard_capacity"])

    @property
    def selector(self) -> AnySelector:
        """What `sample_prioritized`, `sample_windows` and `iterate` draw by, as resolved."""
        return cast(AnySelector, self._law)

    @property
    def beta(self) -> float:
        """Current importance-sampling exponent."""
        return self._state.beta

    @property
    def rate_limiter(self) -> RateLimiterConfig | None:
        """The rate limiter's configuration, or ``None``."""
        return settings.limiter_from(self._config["rate_limiter"])

    def __len__(self) -> int:
        return int(self.stats()["transitions_stored"])

    def __repr__(self) -> str:
        return (
            f"ShardedReplay(num_shards={self.num_shards}, capacity={self.capacity}, "
            f"unit={self.unit!r}, backend={self.backend!r})"
        )

    # --------------------------------------------------------------------------- adding
    def add(self, episode: Episode, *, timeout: float | None = None) -> int:
        """Store ``episode`` whole on the next shard (round robin); return its global id.

        Waits while the rate limiter holds inserts back (up to ``timeout`` seconds, ``None``
        for ever). Raises what `SequenceReplay.add` raises, and `RateLimiterTimeout`; a
        refused call stores nothing and counts nothing.
        """
        return self.extend([episode], timeout=timeout)[0]

    def extend(self, episodes: Iterable[Episode], *, timeout: float | None = None) -> list[int]:
        """Add several episodes, one call per shard in parallel; all are checked first."""
        self._check_open()
        return routing.add(self, list(episodes), settings.checked_timeout(timeout))

    # ------------------------------------------------------------------------- sampling
    def sample(
        self,
        batch_size: int,
        length: int,
        *,
        device: torch.device | str | None = None,
        timeout: float | None = None,
    ) -> Batch:
        """Chunks of ``length`` steps drawn uniformly over every shard (as `SequenceReplay`)."""
        spec = draw.chunk_spec(batch_size, length, Uniform(), weights=False)
        batch = self._draw(spec, device, timeout)
        assert isinstance(batch, Batch)
        return batch

    def sample_prioritized(
        self,
        batch_size: int,
        length: int,
        *,
        device: torch.device | str | None = None,
        timeout: float | None = None,
    ) -> PrioritizedBatch:
        """Chunks drawn by the `selector` over every shard, weights normalised over the batch."""
        spec = draw.chunk_spec(batch_size, length, self._law, weights=True)
        batch = self._draw(spec, device, timeout)
        assert isinstance(batch, PrioritizedBatch)  # a prioritized draw has weights
        return batch

    def sample_windows(
        self,
        batch_size: int,
        window: Window,
        *,
        prioritized: bool | None = None,
        device: torch.device | str | None = None,
        timeout: float | None = None,
    ) -> WindowBatch:
        """Anchors drawn over every shard and expanded into ``window`` (see `Window`).

        ``prioritized=None`` means the `selector` (True: by priority, False: uniformly,
        without weights). The law, ``probabilities`` and weights are the single buffer's
        over all stored episodes; `RateLimiterTimeout` after ``timeout`` seconds of waiting.
        """
        spec = draw.window_spec(batch_size, window, prioritized, self._law, self.alpha)
        batch = self._draw(spec, device, timeout)
        assert isinstance(batch, WindowBatch)
        return batch

    def _draw(self, spec: draw.Spec, device: Any, timeout: Any) -> Batch | WindowBatch:
        target = check_device("device", "cpu" if device is None else device)
        return coordination.draw_batch(self, spec, target, settings.checked_timeout(timeout))

    def iterate(
        self,
        batch_size: int,
        window: Window,
        *,
        prefetch: int = 2,
        device: torch.device | str | None = None,
        timeout: float | None = None,
    ) -> Iterator[WindowBatch]:
        """Endless prioritized `sample_windows` batches, the next one drawn ahead.

        The shards draw the next batch while the learner computes on this one, in one
        round trip each: every draw call also reports the shard's masses after it, from
        which the next draw is labelled (`lucid_replay.distributed.stream` gives the order
        of reads and draws, and when the masses are read afresh). One draw is in flight
        whatever ``prefetch`` (checked, ``>= 1``), since a second one could not be labelled
        before the first reports; the batches equal successive `sample_windows` calls
        without other callers. Priority updates queued with ``defer=True`` ride the next
        draw call.
        """
        spec = draw.window_spec(batch_size, window, None, self._law, self.alpha)
        check_prefetch(prefetch)
        target = check_device("device", "cpu" if device is None else device)
        timeout = settings.checked_timeout(timeout)
        return BatchStream(self, spec, prefetch, target, timeout)

    # ------------------------------------------------------------------------ reporting
    def stats(self) -> dict[str, Any]:
        """The single buffer's counters summed over shards, plus losses and per-shard detail.

        Extra keys: ``episodes_lost`` / ``transitions_lost`` (with shards that died since
        their last checkpoint), ``priority_updates_skipped`` (ids evicted or lost, counted
        by this client), ``shards`` (each shard's own stats, incarnation and process) and
        ``limiter`` (the rate limiter's counters, or ``None``: ``inserts`` transitions the
        shards stored, ``pending`` admitted but not stored yet, ``deletes`` evicted or lost,
        ``samples`` drawn; ``size`` and ``error`` count stored transitions only).
        """
        self._check_open()
        self._flush_updates()
        per_shard = calls.get([s.stats.remote() for s in self._call_handles()])
        shared = calls.get(self._control.state.remote())
        limited = self._config["rate_limiter"] is not None
        return summary(per_shard, shared, self._state.skipped, limited=limited)

    # ---------------------------------------------------------------------- persistence
    def save(self, directory: str | os.PathLike[str]) -> None:
        """Write every shard's file, then the manifest that binds them, into ``directory``.

        Atomic as a whole: the new files get new names, the manifest's rename commits them,
        and only then are the previous save's files removed; a save that fails leaves the
        previous one loadable (`lucid_replay.distributed.checkpoints`). ``directory`` is
        created if needed; one replay saves into it at a time.
        """
        self._check_open()
        with self._lock:
            self._flush_updates()
            checkpoints.save_replay(self, directory)
