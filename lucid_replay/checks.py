"""Argument checks at the public boundary: ints, reals, flags, devices and numeric vectors.

Each check returns the value in the form the package computes with, or raises the error that
`lucid_replay.errors` phrases. ``bool`` is never accepted where an ``int`` or a real number is
expected (it is a Python ``int``), and a flag must be a real ``bool``.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np
import torch

from lucid_replay.errors import must, must_have, wrong_kind, wrong_type

__all__: list[str] = []  # internal module

INT64_MAX = 2**63 - 1
_usable_devices: set[torch.device] = set()


def as_id(param: str, value: Any) -> int:
    """``value`` as an id (an ``int``; numpy integers too, never a ``bool``).

    Whether the id is known is the caller's question (a ``KeyError`` there, not here).
    """
    if isinstance(value, bool):
        raise wrong_type(param, "an int", value)
    try:
        return operator.index(value)
    except TypeError:
        raise wrong_type(param, "an int", value) from None


def check_int(param: str, value: Any, *, minimum: int, maximum: int = INT64_MAX) -> int:
    """Return ``value`` as an ``int`` after checking ``minimum <= value <= maximum``.

    Python and numpy integers are accepted (``bool`` is not). The default maximum keeps every
    accepted value an int64, which is what the index arithmetic computes in.

    Raises
    ------
    TypeError
        If ``value`` is not an integer.
    InvalidArgumentError
        If it lies outside the range.
    """
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
        raise wrong_type(param, "an int", value)
    number = int(value)
    if number < minimum:
        raise must(param, f">= {minimum}", number)
    if number > maximum:
        raise must(param, f"<= {maximum}", number)
    return number


UNITS = ("chunk", "episode")  # what a draw picks first: the anchor, or its episode
MAX_BATCH = 2**31 - 1  # the most rows a batch may have
MAX_PREFETCH = 2**16  # the most batches `iterate` may draw ahead


def check_batch_size(batch_size: Any) -> int:
    """``batch_size`` as an int in ``[1, MAX_BATCH]``."""
    return check_int("batch_size", batch_size, minimum=1, maximum=MAX_BATCH)


def check_prefetch(prefetch: Any) -> int:
    """``prefetch`` (batches drawn ahead) as an int in ``[1, MAX_PREFETCH]``."""
    return check_int("prefetch", prefetch, minimum=1, maximum=MAX_PREFETCH)


def check_unit(unit: Any) -> str:
    """``unit``, one of `UNITS`."""
    if not isinstance(unit, str) or unit not in UNITS:
        raise must("unit", f"one of {UNITS}", unit)
    return unit


def check_float(
    param: str,
    value: Any,
    *,
    minimum: float,
    maximum: float | None = None,
    strict: bool = False,
) -> float:
    """Return ``value`` as a finite ``float`` in range.

    ``value >= minimum`` (``>`` if ``strict``) and, if given, ``value <= maximum``.

    Raises
    ------
    TypeError
        If ``value`` is not a real number (``bool`` is refused too).
    InvalidArgumentError
        If it is below the minimum or not finite (``"must be >= 0.0 and finite"``), or above
        the maximum (``"must be in [0, 1]"``).
    """
    if isinstance(value, bool | np.bool_) or not isinstance(
        value, int | float | np.integer | np.floating
    ):
        raise wrong_type(param, "a real number", value)
    number = float(value)
    low_ok = number > minimum if strict else number >= minimum
    if not (low_ok and np.isfinite(number)):
        raise must(param, f"{'>' if strict else '>='} {minimum} and finite", value)
    if maximum is not None and number > maximum:
        raise must(param, f"in [{minimum:g}, {maximum:g}]", value)
    return number


def check_bool(param: str, value: Any) -> bool:
    """Return ``value`` if it is a ``bool`` (numpy's included); refuse anything else."""
    if not isinstance(value, bool | np.bool_):
        raise wrong_type(param, "a bool", value)
    return bool(value)


def check_device(param: str, device: Any) -> torch.device:
    """Return ``device`` as a `torch.device` this process can allocate on.

    Parsed and probed (a 0-element tensor is made there, once per device), so that a call
    refuses ``"banana"`` or ``"cuda"`` without CUDA before it draws or writes anything.
    """
    if isinstance(device, bool) or not isinstance(device, str | torch.device | int):
        raise wrong_type(param, "a torch.device or a device string", device)
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise must(param, "a torch device such as 'cpu' or 'cuda:0'", device) from None
    if parsed not in _usable_devices:
        try:
            torch.empty(0, device=parsed)
        except Exception as error:  # torch raises RuntimeError, AssertionError, ...
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise must_have(
                param, "a device this process can use", f"{device!r}: {reason}"
            ) from None
        _usable_devices.add(parsed)
    return parsed


def as_tensor(param: str, values: Any) -> torch.Tensor:
    """Lists, numpy arrays or tensors (any device) of real numbers -> a detached tensor.

    Python sequences go through numpy, which keeps Python floats in float64 (torch would round
    them to float32 first, changing ``|error| + epsilon`` and overflowing beyond 3.4e38).
    Complex values are refused: they have no order, and dropping the imaginary part would
    lose data silently.
    """
    if isinstance(values, torch.Tensor):
        tensor = values.detach()
    else:
        try:
            array = np.asarray(values)
        except (TypeError, ValueError, RuntimeError):
            raise wrong_type(param, "array-like real numbers", values) from None
        if array.dtype.kind == "c":
            raise wrong_kind(param, "real numbers", f"dtype {array.dtype}")
        if array.dtype.kind not in "biuf":
            raise wrong_kind(param, "array-like real numbers", f"dtype {array.dtype}")
        tensor = torch.from_numpy(array)
    if tensor.is_complex():
        raise wrong_kind(param, "real numbers", f"dtype {tensor.dtype}")
    return tensor


def as_vector(param: str, values: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Numbers as a detached 1-d tensor of ``dtype`` on ``device``.

    For ``dtype=torch.int64`` (ids, steps) only integer dtypes are accepted: a float or a
    ``bool`` is never an id.
    """
    tensor = as_tensor(param, values)
    if tensor.dim() != 1:
        raise must(param, "one-dimensional", tuple(tensor.shape))
    if (
        dtype == torch.int64
        and tensor.numel()
        and (tensor.is_floating_point() or tensor.dtype == torch.bool)
    ):
        raise wrong_kind(param, "integers", f"dtype {tensor.dtype}")
    return tensor.to(device=device, dtype=dtype)


def make_generator(seed: Any, device: torch.device) -> torch.Generator:
    """The random generator ``seed`` stands for.

    ``seed`` itself if it is a `torch.Generator`; else a new generator on ``device`` seeded
    with ``seed`` (an int in ``[0, 2**64)``), or from the OS for ``None``.
    """
    if isinstance(seed, torch.Generator):
        return seed
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(check_int("seed", seed, minimum=0, maximum=2**64 - 1))
    return generator
