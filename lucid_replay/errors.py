"""Exceptions and the one place that phrases and checks argument rules.

Every refusal in the package goes through the helpers here, so that messages follow a
single template (``"<param> must be <rule>, got <value!r>"``) and every error also
subclasses the builtin a caller would naturally catch (``ValueError``, ``TypeError``,
``KeyError``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = [
    "CheckpointError",
    "InvalidArgumentError",
    "LucidReplayError",
    "ReuseLimitError",
    "SchemaDtypeError",
    "SchemaError",
    "UnknownEpisodeError",
]


class LucidReplayError(Exception):
    """Base class of every error raised by lucid_replay on purpose."""


class InvalidArgumentError(LucidReplayError, ValueError):
    """An argument broke a documented rule (a range, a length, a finite value)."""


class SchemaError(LucidReplayError, ValueError):
    """An episode's fields or per-step shapes differ from the buffer's schema."""


class SchemaDtypeError(LucidReplayError, TypeError):
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


def must(param: str, rule: str, got: Any) -> InvalidArgumentError:
    """Return the error for ``param`` breaking ``rule``, phrased with the house template."""
    return InvalidArgumentError(f"{param} must be {rule}, got {got!r}")


def check_int(param: str, value: Any, *, minimum: int) -> int:
    """Return ``value`` as an ``int`` after checking it is an integer ``>= minimum``.

    Raises
    ------
    TypeError
        If ``value`` is not an integer (``bool`` is refused too).
    InvalidArgumentError
        If ``value < minimum``.
    """
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{param} must be an int, got {value!r}")
    if value < minimum:
        raise must(param, f">= {minimum}", value)
    return int(value)


def check_float(param: str, value: Any, *, minimum: float, strict: bool = False) -> float:
    """Return ``value`` as a finite ``float`` after checking ``value >= minimum``.

    With ``strict=True`` the bound is exclusive (``value > minimum``).
    """
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise TypeError(f"{param} must be a real number, got {value!r}")
    number = float(value)
    ok = number > minimum if strict else number >= minimum
    if not (ok and np.isfinite(number)):
        raise must(param, f"{'>' if strict else '>='} {minimum} and finite", value)
    return number


def as_tensor(name: str, values: Any) -> torch.Tensor:
    """Lists, numpy arrays or tensors (any device) -> a detached tensor.

    Python sequences go through numpy, which keeps Python floats in float64 (torch would round
    them to float32 first, changing ``|error| + epsilon`` and overflowing beyond 3.4e38).
    """
    if isinstance(values, torch.Tensor):
        return values.detach()
    try:
        array = np.asarray(values)
        if array.dtype.kind not in "biuf":
            raise TypeError
        return torch.from_numpy(array)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"{name} must be array-like numbers, got {type(values).__name__}") from None


def as_vector(name: str, values: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Lists, numpy arrays or tensors (any device) -> a detached 1-D tensor on ``device``."""
    tensor = as_tensor(name, values)
    if tensor.dim() != 1:
        raise must(name, "one-dimensional", tuple(tensor.shape))
    integral = not (tensor.is_floating_point() or tensor.is_complex())
    if dtype == torch.int64 and not integral and tensor.numel():
        raise TypeError(f"{name} must hold integers, got dtype {tensor.dtype}")
    return tensor.to(device=device, dtype=dtype)
