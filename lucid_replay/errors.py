"""Exceptions, and the one place that phrases a refusal.

Every refusal in the package is phrased by `must`, `must_have`, `wrong_type` or `wrong_kind`,
so that messages follow a single template (``"<param> must be <rule>, got <value!r>"``), and
every error derives from `LucidReplayError` and also subclasses the builtin a caller would
naturally catch (``ValueError``, ``TypeError``, ``KeyError``, ``TimeoutError``). The checks that
use them live in `lucid_replay.checks`.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "CheckpointError",
    "EpisodesNotStoredError",
    "InvalidArgumentError",
    "InvalidTypeError",
    "LucidReplayError",
    "RateLimiterTimeout",
    "ReuseLimitError",
    "SchemaDtypeError",
    "SchemaError",
    "UnknownEpisodeError",
]


class LucidReplayError(Exception):
    """Base class of every error raised by lucid_replay on purpose."""


class InvalidArgumentError(LucidReplayError, ValueError):
    """An argument broke a documented rule (a range, a length, a finite value)."""


class InvalidTypeError(LucidReplayError, TypeError):
    """An argument has the wrong type or kind (a float id, a bool count, a mapping array)."""


class SchemaError(LucidReplayError, ValueError):
    """An episode's fields or per-step shapes differ from the buffer's schema."""


class SchemaDtypeError(InvalidTypeError):
    """An episode field has another dtype than the buffer's schema, or is not array-like."""


class ReuseLimitError(LucidReplayError, ValueError):
    """A draw asked for more samples than the reuse limit (``max_times_sampled``) leaves."""


class CheckpointError(LucidReplayError, ValueError):
    """A file or state dict is not a lucid_replay checkpoint this version can read."""


class UnknownEpisodeError(LucidReplayError, KeyError):
    """An episode id was never issued or has been evicted."""

    def __str__(self) -> str:
        # KeyError quotes its argument; a sentence reads better unquoted.
        return str(self.args[0]) if self.args else ""


class RateLimiterTimeout(LucidReplayError, TimeoutError):
    """A rate limiter kept an insert or a sample waiting past its ``timeout``.

    Nothing was inserted or drawn: the call can be retried as it was.
    """


class EpisodesNotStoredError(LucidReplayError, ValueError):
    """The buffer refused some of the episodes a call finished; the others were stored.

    Raised by `EpisodeWriter` and `TrajectoryAssembler` after they offered every episode the
    call finished to the buffer, ``from`` the first error the buffer raised. The call itself
    was taken: the collector's state advanced as for a successful call (do not repeat it, or
    its steps are recorded twice), and the refused episodes are handed back here so that
    they can be stored elsewhere or later.

    Attributes
    ----------
    stored_ids
        The ids the buffer issued in this call, in the order the episodes were offered.
    refused
        Key of each refused episode -> the exception the buffer raised for it. The key is the
        env index for `EpisodeWriter`, the episode's position in the call's order of finished
        episodes for `TrajectoryAssembler`.
    episodes
        The same keys -> the refused `Episode` objects.
    """

    def __init__(
        self,
        message: str,
        stored_ids: list[int],
        refused: dict[int, Exception],
        episodes: dict[int, Any],
    ) -> None:
        super().__init__(message, stored_ids, refused, episodes)  # all in args: it pickles
        self.stored_ids = list(stored_ids)
        self.refused = dict(refused)
        self.episodes = dict(episodes)

    @classmethod
    def of(
        cls,
        stored_ids: list[int],
        refused: dict[int, Exception],
        episodes: dict[int, Any],
        *,
        label: str,
    ) -> EpisodesNotStoredError:
        """The error for ``refused`` (``label``: what a key is, ``"env"`` or ``"episode"``)."""
        causes = "; ".join(
            f"{label} {key}: {type(error).__name__}: {error}" for key, error in refused.items()
        )
        offered = len(stored_ids) + len(refused)
        return cls(
            f"buffer must accept every episode this call finished, got {len(refused)} of "
            f"{offered} refused ({causes}); stored ids {stored_ids}",
            stored_ids,
            refused,
            episodes,
        )

    def __str__(self) -> str:
        return str(self.args[0])


def must(param: str, rule: str, got: Any) -> InvalidArgumentError:
    """Return the error for ``param`` breaking ``rule``, phrased with the house template.

    ``got`` is quoted with ``repr``; use `must_have` for an observation that is a phrase.
    """
    return InvalidArgumentError(f"{param} must be {rule}, got {got!r}")


def must_have(param: str, rule: str, observed: str) -> InvalidArgumentError:
    """As `must`, with ``observed`` already phrased (``"a NaN"``, ``"0 stored episodes"``)."""
    return InvalidArgumentError(f"{param} must be {rule}, got {observed}")


def wrong_type(param: str, rule: str, got: Any) -> InvalidTypeError:
    """The `InvalidTypeError` for a ``param`` of the wrong kind, in the house template.

    ``got`` is shown by its ``repr`` when that is short, else by its type's name.
    """
    shown = repr(got)
    return wrong_kind(param, rule, shown if len(shown) <= 60 else f"a {type(got).__name__}")


def wrong_kind(param: str, rule: str, observed: str) -> InvalidTypeError:
    """As `wrong_type`, with ``observed`` already phrased (``"dtype torch.bool"``)."""
    return InvalidTypeError(f"{param} must be {rule}, got {observed}")


# The refusals of a draw, written once: one buffer and the shards (whose client refuses what
# the single buffer over all of their episodes would) raise the same messages.
def empty_buffer() -> InvalidArgumentError:
    """A draw from a buffer (or every shard) with no episode stored."""
    return must_have("the buffer", "non-empty to sample", "0 stored episodes")


def span_too_long(what: str, span: int, longest: int) -> InvalidArgumentError:
    """A draw of ``what`` (the span's name) longer than every stored episode."""
    return must(what, f"<= the longest stored episode ({longest} steps)", span)


def span_not_committed(what: str, need: int, longest: int) -> InvalidArgumentError:
    """A draw whose only episodes are open ones too short for ``need`` committed steps."""
    return must_have(
        what,
        f"a span that open episodes' committed steps hold ({need} steps with the bootstrap "
        "records)",
        f"{longest} committed steps at most",
    )


def reuse_limit_reached(
    reuse_limit: int | None, left: int | None, batch_size: int
) -> ReuseLimitError:
    """A draw of ``batch_size`` beyond the ``left`` draws the reuse limit still allows."""
    return ReuseLimitError(
        f"batch_size must be <= the draws left under max_times_sampled={reuse_limit} for "
        f"the eligible episodes ({left}), got {batch_size}"
    )
