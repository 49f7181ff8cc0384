"""Rate limiting as Reverb does it: `SampleToInsertRatio` and `MinSize`, and their state machine.

A limiter keeps four counters: ``inserts`` (transitions the shards have stored), ``pending``
(transitions admitted but not stored yet: an add in flight), ``deletes`` (transitions evicted
or lost since) and ``samples`` (chunks or windows drawn). An insert is admitted against what
will be stored once every admitted add lands (``inserts + pending``), and counts towards what
samplers wait on only once the shards stored it (`RateLimiter.commit_insert`): a sampler
waiting for ``min_size`` is never released into a replay that does not hold the data yet.
With ``size = inserts - deletes`` and ``error = inserts * samples_per_insert - samples``:

* a sample of ``n`` may proceed iff ``size >= min_size`` and ``error - n >= min_diff``;
* an insert of ``n`` transitions may proceed iff ``size' + n <= min_size`` (inserts are free
  until the replay can be sampled) or ``error' + n * samples_per_insert <= max_diff``, where
  ``size'`` and ``error'`` count the pending transitions as inserted.

A call that may not proceed waits (up to its ``timeout``) until another call moves the
counters, then raises `RateLimiterTimeout` with nothing counted.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import attrs

from lucid_replay.checks import check_float, check_int
from lucid_replay.errors import RateLimiterTimeout, must, wrong_type

__all__ = ["MinSize", "SampleToInsertRatio"]

_WAIT_SLICE_S = 5.0  # a remote limiter never blocks a call longer; clients call again


def _positive_int(instance: object, attribute: attrs.Attribute[int], value: Any) -> None:
    check_int(attribute.name, value, minimum=1)


def _non_negative_int(instance: object, attribute: attrs.Attribute[int], value: Any) -> None:
    check_int(attribute.name, value, minimum=0)


def _positive_float(instance: object, attribute: attrs.Attribute[float], value: Any) -> None:
    check_float(attribute.name, value, minimum=0.0, strict=True)


@attrs.frozen
class MinSize:
    """Sampling waits until the replay holds ``min_size`` transitions; inserts never wait.

    Parameters
    ----------
    min_size
        Transitions stored before the first sample may proceed. ``>= 1``.

    Examples
    --------
    >>> MinSize(1000).bounds()
    (1000, 1.0, -inf, inf)
    """

    min_size: int = attrs.field(validator=_positive_int)

    def bounds(self) -> tuple[int, float, float, float]:
        """``(min_size, samples_per_insert, min_diff, max_diff)`` of the state machine."""
        return self.min_size, 1.0, -float("inf"), float("inf")


def _error_buffer(instance: SampleToInsertRatio, attribute: Any, value: Any) -> None:
    if isinstance(value, tuple):
        if len(value) != 2:
            raise must("error_buffer", "a number or a (min_diff, max_diff) pair", value)
        for part in value:
            check_float("error_buffer", part, minimum=-float("inf"))
    elif isinstance(value, bool) or not isinstance(value, int | float):
        raise wrong_type("error_buffer", "a number or a (min_diff, max_diff) pair", value)
    else:
        check_float("error_buffer", value, minimum=0.0)


@attrs.frozen
class SampleToInsertRatio:
    r"""Keep ``samples_per_insert`` drawn chunks or windows per inserted transition on average.

    Parameters
    ----------
    samples_per_insert
        Target ratio of samples (chunks or windows drawn) to inserts (transitions stored).
        A learner drawing ``B`` windows per step from episodes of ``T`` steps collected at
        ``U`` steps per update uses ``B / U``. ``> 0``.
    min_size
        Transitions stored before the first sample; inserts are free until then. ``>= 1``.
    error_buffer
        How far the ratio may drift, in samples: a number ``b`` gives ``min_diff =
        samples_per_insert * min_size - b`` and ``max_diff = samples_per_insert * min_size +
        b``; a pair gives ``(min_diff, max_diff)`` as they are.

    Raises
    ------
    InvalidArgumentError
        If ``max_diff - min_diff < 2 * max(1, samples_per_insert)`` (Reverb's rule: a
        narrower band can block both sides), or for a value out of range.

    Notes
    -----
    Samples are counted in chunks or windows (``batch_size`` per call) and inserts in
    transitions (an episode's length), so the band must also let whole calls through:
    ``max_diff - min_diff`` must exceed the batch size and ``samples_per_insert`` times the
    longest episode, or a call can wait forever (Reverb counts one item per call).

    Examples
    --------
    >>> limiter = SampleToInsertRatio(2.0, min_size=100, error_buffer=50)
    >>> limiter.bounds()
    (100, 2.0, 150.0, 250.0)
    """

    samples_per_insert: float = attrs.field(validator=_positive_float)
    min_size: int = attrs.field(validator=_non_negative_int)
    error_buffer: float | tuple[float, float] = attrs.field(validator=_error_buffer)

    def __attrs_post_init__(self) -> None:
        _, spi, low, high = self.bounds()
        if high - low < 2 * max(1.0, spi):
            raise must(
                "error_buffer",
                f"a band max_diff - min_diff >= 2 * max(1, samples_per_insert) = "
                f"{2 * max(1.0, spi):g}",
                self.error_buffer,
            )

    def bounds(self) -> tuple[int, float, float, float]:
        """``(min_size, samples_per_insert, min_diff, max_diff)`` of the state machine."""
        spi = float(self.samples_per_insert)
        if isinstance(self.error_buffer, tuple):
            low, high = (float(x) for x in self.error_buffer)
        else:
            offset = spi * self.min_size
            low, high = offset - self.error_buffer, offset + self.error_buffer
        return self.min_size, spi, low, high


RateLimiterConfig = SampleToInsertRatio | MinSize


def check_limiter(value: object) -> RateLimiterConfig | None:
    """Refuse a ``rate_limiter`` that is neither ``None`` nor one of the two limiters."""
    if value is not None and not isinstance(value, SampleToInsertRatio | MinSize):
        raise wrong_type("rate_limiter", "a SampleToInsertRatio, a MinSize or None", value)
    return value


class RateLimiter:
    """The counters of a limiter and the waits on them (thread-safe).

    Every method is one atomic step; `acquire_insert` / `acquire_sample` wait on a condition
    until the step is allowed or ``timeout`` seconds passed (``None``: no limit). An admitted
    insert is pending until `commit_insert` says how much of it the shards stored.
    """

    def __init__(self, config: RateLimiterConfig | None) -> None:
        self.config = config
        bounds = (0, 1.0, -float("inf"), float("inf")) if config is None else config.bounds()
        self.min_size, self.samples_per_insert, self.min_diff, self.max_diff = bounds
        self.inserts = 0
        self.pending = 0
        self.deletes = 0
        self.samples = 0
        self._changed = threading.Condition()

    # -------------------------------------------------------------------------- rules
    @property
    def size(self) -> int:
        """Transitions stored: ``inserts - deletes`` (pending inserts not included)."""
        return self.inserts - self.deletes

    def error(self, pending: bool = False) -> float:
        """``inserts * samples_per_insert - samples`` (``pending``: as if they were stored)."""
        inserts = self.inserts + (self.pending if pending else 0)
        return inserts * self.samples_per_insert - self.samples

    def can_insert(self, n: int) -> bool:
        """Whether an insert of ``n`` transitions may proceed now (pending ones counted)."""
        if self.size + self.pending + n <= self.min_size:
            return True
        return self.error(pending=True) + n * self.samples_per_insert <= self.max_diff

    def can_sample(self, n: int) -> bool:
        """Whether a sample of ``n`` chunks or windows may proceed now (stored data only)."""
        return self.size >= self.min_size and self.error() - n >= self.min_diff

    # -------------------------------------------------------------------------- steps
    def acquire_insert(self, n: int, timeout: float | None) -> None:
        """Admit an insert of ``n`` transitions (pending) once allowed; else time out."""
        self._acquire(n, timeout, inserting=True)

    def acquire_sample(self, n: int, timeout: float | None) -> None:
        """Count a sample of ``n`` once allowed; `RateLimiterTimeout` if not in time."""
        self._acquire(n, timeout, inserting=False)

    def _acquire(self, n: int, timeout: float | None, *, inserting: bool) -> None:
        allowed = self.can_insert if inserting else self.can_sample
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while not allowed(n):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    what = f"insert of {n} transitions" if inserting else f"sample of {n}"
                    raise RateLimiterTimeout(
                        f"timeout must be long enough for the rate limiter to allow the "
                        f"{what}, got {timeout!r} s (state: {self.state()})"
                    )
                self._changed.wait(left)
            if inserting:
                self.pending += n
            else:
                self.samples += n
            self._changed.notify_all()

    def try_acquire(self, n: int, *, inserting: bool, wait_s: float | None) -> bool:
        """`acquire_insert` / `acquire_sample` waiting at most ``wait_s`` (5 s for ``None``).

        False instead of raising: what a remote client calls in a loop.
        """
        wait = _WAIT_SLICE_S if wait_s is None else min(wait_s, _WAIT_SLICE_S)
        try:
            self._acquire(n, wait, inserting=inserting)
        except RateLimiterTimeout:
            return False
        return True

    def commit_insert(self, stored: int, refused: int = 0) -> None:
        """Of admitted (pending) transitions, count ``stored`` as inserted, drop ``refused``.

        What samplers wait on moves here, once the shards replied, never at admission.
        """
        with self._changed:
            self.pending -= stored + refused
            self.inserts += stored
            self._changed.notify_all()

    def release(self, samples: int = 0, deletes: int = 0) -> None:
        """Undo the counted samples of a refused draw, or count deleted transitions."""
        with self._changed:
            self.samples -= samples
            self.deletes += deletes
            self._changed.notify_all()

    # ----------------------------------------------------------------------- reporting
    def state(self) -> dict[str, Any]:
        """The counters and the band, for `stats` and checkpoints.

        ``inserts``: transitions stored; ``pending``: admitted, not stored yet; ``deletes``:
        evicted or lost; ``samples``: drawn; ``size`` and ``error`` from the stored ones.
        """
        return {
            "inserts": self.inserts,
            "pending": self.pending,
            "deletes": self.deletes,
            "samples": self.samples,
            "size": self.size,
            "error": self.error(),
            "min_size": self.min_size,
            "min_diff": self.min_diff,
            "max_diff": self.max_diff,
        }

    def restore(self, counters: dict[str, int]) -> None:
        """Adopt saved ``inserts``, ``deletes`` and ``samples`` (nothing is pending then)."""
        with self._changed:
            self.inserts = int(counters["inserts"])
            self.pending = 0
            self.deletes = int(counters["deletes"])
            self.samples = int(counters["samples"])
            self._changed.notify_all()
