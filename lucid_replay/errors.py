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
