"""Where the index arithmetic runs: compiled loops, numpy views, or tensors. One formula each.

Sampling, window expansion and priority bookkeeping work on vectors of a few hundred
elements, where the cost is per operation, not per element: a torch op on CPU costs about
5 us of dispatch, the same numpy op on the same memory about 1 us, and a compiled loop over
the elements less than either. So there are three engines:

* ``"kernels"`` (CPU storage, the optional extra ``fast``): a loop registered with `jit`
  runs compiled by numba, element by element, with the same IEEE float64 operations in the
  same order as the array code beside it, so its results are bitwise the array code's;
* ``"numpy"`` (CPU storage without numba, or with ``LUCID_REPLAY_KERNELS=0``): the array
  code on numpy views of the tensors (`view`; `Tensor.numpy` shares memory);
* ``"torch"`` (storage on an accelerator): the same array code on the tensors themselves.

Arithmetic, comparisons and indexing are spelled alike for numpy arrays and tensors; the
few operations that are not are the helpers below. Each compiled loop is a module-level
function decorated with `jit` in the module whose array code it mirrors, and its callers
branch on `compiled`. `jit` leaves the Python function in place; the first time `compiled`
answers True, every registered loop's module global is replaced by its numba dispatcher
(before any of them is compiled, so that loops calling loops, also in another module
through ``module.loop``, compile against each other), compiled on first call and cached on
disk. Inside them `prefetch(address)` is a cache hint (`prefetchers`), a no-op from Python.
Numba checks a cached loop against its own file only: after editing a loop that a loop
in another module calls, touch that module (or clear ``__pycache__``); the engine-equality
tests catch a stale build. `use` switches engines (tests run every path on CPU with it).
This module imports nothing from lucid_replay.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeAlias, TypeVar

import numpy as np
import torch

__all__: list[str] = []  # internal module

# A numpy array (CPU) or a tensor (elsewhere). The code using it is written against what both
# spell alike, which no static type expresses, so it is typed as Any; tests run that code on
# every engine (see `use`).
Array: TypeAlias = Any
ENGINES = ("kernels", "numpy", "torch")

_Loop = TypeVar("_Loop", bound=Callable[..., Any])
_NUMPY_DTYPES = {
    torch.bool: np.bool_,
    torch.int64: np.int64,
    torch.float32: np.float32,
    torch.float64: np.float64,
}

_numpy_on_cpu = True  # False runs the accelerator's code path (tensors) on CPU
_kernels_on = os.environ.get("LUCID_REPLAY_KERNELS", "1") != "0"
_loops: list[Callable[..., Any]] = []  # registered by `jit`, in import order
_compiled_ready: bool | None = None  # None: numba not tried yet; False: missing
_swap_lock = threading.Lock()
_prefetchers: tuple[Any, Any] | None = None  # see `prefetchers`


# ------------------------------------------------------------------- the compiled loops
def jit(loop: _Loop) -> _Loop:
    """Register the module-level ``loop`` as a compiled twin of the array code beside it.

    Returns ``loop`` itself until the compiled engine is first used; from then on (also for
    loops registered later) its numba dispatcher (``njit(cache=True, nogil=True)``), which
    replaces it in its module. Callers reach it through that module's global name, never
    through a reference taken at import time.
    """
    with _swap_lock:
        _loops.append(loop)
        if _compiled_ready:
            return _compile(loop)  # type: ignore[no-any-return]
    return loop


def compiled(values: Array) -> bool:
    """Whether the compiled loops run on ``values``: numpy arrays, with the kernels on."""
    return _kernels_on and isinstance(values, np.ndarray) and _ready()


def available() -> bool:
    """Whether numba can be imported, so that the ``"kernels"`` engine can run."""
    return _ready()


def prefetch(address: int) -> None:
    """Hint that the cache line at ``address`` (an int64) is about to be read.

    In a compiled loop, LLVM's prefetch (`prefetchers`): the miss starts now, while the
    loop goes on; it never faults and changes no byte, so any address may be named. Called
    from Python it does nothing.
    """


def _compile_prefetch() -> None:
    """Compile `prefetch` in loops as the read hint of `prefetchers` (Python's stays a no-op)."""
    from numba.extending import overload

    read = prefetchers()[0]

    @overload(prefetch)
    def _hint(address: Any) -> Any:
        def hint(address: Any) -> None:
            read(address)

        return hint


@jit
def prefetch_entry(values: np.ndarray, index: int) -> None:
    """`prefetch` of the cache line holding ``values[index]`` (1-d, any stride)."""
    prefetch(np.int64(values.ctypes.data) + index * np.int64(values.strides[0]))


def prefetchers() -> tuple[Any, Any]:
    """The compiled loops' cache hints: ``(read, write)``, each ``hint(address)``.

    Numba intrinsics for LLVM's prefetch of the line at an int64 address (into every cache
    level), built once; `prefetch` is the first inside compiled loops. Needs numba.
    """
    global _prefetchers
    if _prefetchers is None:
        from llvmlite import ir  # type: ignore[import-untyped]  # no py.typed
        from numba import types
        from numba.core import cgutils
        from numba.extending import intrinsic

        pointer, word = cgutils.voidptr_t, ir.IntType(32)
        signature = ir.FunctionType(ir.VoidType(), [pointer, word, word, word])

        def hint(write: int) -> Any:
            def typed(typing_context: Any, address: Any) -> Any:
                def generate(context: Any, builder: Any, signature_: Any, args: Any) -> Any:
                    function = builder.module.declare_intrinsic(
                        "llvm.prefetch", [pointer], signature
                    )
                    # read (0) or write (1); locality 3: keep it in all levels; 1: data
                    where = builder.inttoptr(args[0], pointer)
                    builder.call(function, [where, word(write), word(3), word(1)])
                    return context.get_dummy_value()

                return types.void(types.int64), generate

            return intrinsic(typed)

        _prefetchers = (hint(0), hint(1))
    return _prefetchers


def _ready() -> bool:
    """Import numba and swap in every registered loop's dispatcher, once; False without it."""
    global _compiled_ready
    if _compiled_ready is None:
        with _swap_lock:
            if _compiled_ready is None:
                try:
                    import numba  # noqa: F401  # the optional extra "fast"
                except ImportError:
                    _compiled_ready = False
                else:
                    _compile_prefetch()
                    for loop in _loops:  # all swapped before any is compiled
                        setattr(sys.modules[loop.__module__], loop.__name__, _compile(loop))
                    _compiled_ready = True
    return bool(_compiled_ready)


def _compile(loop: Callable[..., Any]) -> Any:
    import numba

    return numba.njit(cache=True, nogil=True)(loop)


@contextlib.contextmanager
def use(name: str) -> Iterator[None]:
    """Run the index arithmetic on engine ``name`` (one of `ENGINES`) inside the block.

    Tests use it to run every engine's code on CPU; ``"kernels"`` needs numba.
    """
    global _numpy_on_cpu, _kernels_on
    if name not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {name!r}")
    if name == "kernels" and not _ready():
        raise ImportError('the "kernels" engine needs numba: pip install "lucid-replay[fast]"')
    saved = _numpy_on_cpu, _kernels_on
    _numpy_on_cpu, _kernels_on = name != "torch", name == "kernels"
    try:
        yield
    finally:
        _numpy_on_cpu, _kernels_on = saved


def current() -> str:
    """The engine a CPU computation runs on now (``"kernels"``, ``"numpy"`` or ``"torch"``)."""
    if not _numpy_on_cpu:
        return "torch"
    return "kernels" if _kernels_on and _ready() else "numpy"


# --------------------------------------------------------------- numpy views and tensors
def view(values: torch.Tensor) -> Array:
    """``values`` as the array the index arithmetic runs on: a numpy view on CPU."""
    return values.numpy() if _numpy_on_cpu and values.is_cpu else values


def host_views(steps: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray] | None:
    """Numpy views of CPU ``steps`` (the same memory), or None if one has none.

    Copies through them cost a fifth of `Tensor.copy_`'s dispatch, on one thread.
    """
    try:
        return {name: t.detach().numpy() for name, t in steps.items()}
    except (TypeError, RuntimeError):  # a device tensor, or a dtype numpy lacks
        return None


def integer_columns(count: int, rows: int, device: torch.device) -> torch.Tensor:
    """``count`` uninitialised int64 columns of ``rows`` entries, as one matrix ``[count, rows]``.

    Column ``c`` is ``matrix[c]``, so that a compiled loop takes every column as one
    argument. The memory is row-major (each column a strided view): a window reads several
    integers of one row at once (a segment's first step, length, links and base), and they
    then share one or two cache lines instead of one line each. On two cores, gathering 256
    windows across segment seams from a cold table took 3-4% less time than with each
    column contiguous.
    """
    return torch.empty((rows, count), dtype=torch.int64, device=device).T


def tensor(values: Array) -> torch.Tensor:
    """Back to a tensor (a numpy array is wrapped, not copied)."""
    return torch.from_numpy(values) if isinstance(values, np.ndarray) else values


def from_ints(values: list[int], device: torch.device) -> Array:
    """An int64 vector of ``values``, as the engine of ``device`` holds it."""
    if _numpy_on_cpu and device.type == "cpu":
        return np.array(values, dtype=np.int64)
    return torch.tensor(values, dtype=torch.int64, device=device)


# ------------------------------------------------------ operations spelled differently
def cast(values: Array, dtype: torch.dtype) -> Array:
    """``values`` converted to ``dtype`` (a torch dtype for both engines)."""
    if isinstance(values, np.ndarray):
        return values.astype(_NUMPY_DTYPES[dtype], copy=False)
    return values.to(dtype)


def concatenate(parts: list[Array]) -> Array:
    """The 1-d arrays ``parts`` (one engine, at least one) end to end."""
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts)
    return torch.cat(parts)


def minimum(first: Array, second: Array) -> Array:
    """Elementwise minimum of two arrays of one engine."""
    if isinstance(first, np.ndarray):
        return np.minimum(first, second)
    return torch.minimum(first, second)


def where(condition: Array, chosen: Array, otherwise: float) -> Array:
    """``chosen`` where ``condition`` holds, else the scalar ``otherwise`` (``chosen``'s dtype)."""
    if isinstance(condition, np.ndarray):
        return np.where(condition, chosen, otherwise)
    return torch.where(condition, chosen, otherwise)


def all_finite(values: Array) -> bool:
    """Whether no element is NaN or infinite (a host synchronisation on a device)."""
    if isinstance(values, np.ndarray):
        return bool(np.isfinite(values).all())
    return bool(torch.isfinite(values).all())


def flat_nonzero(mask: Array) -> Array:
    """Positions of the True elements of ``mask`` in its flattened (row-major) order."""
    if isinstance(mask, np.ndarray):
        return np.flatnonzero(mask)
    return mask.reshape(-1).nonzero().squeeze(1)


def add_at(target: Array, indices: Array, amount: int) -> None:
    """``target[indices] += amount`` in place, counting repeated indices once each."""
    if isinstance(target, np.ndarray):
        np.add.at(target, indices, amount)
    else:
        target.index_add_(0, indices, torch.full_like(indices, amount, dtype=target.dtype))


def assign_max(target: Array, indices: Array, values: Array) -> None:
    """``target[indices] = values`` in place, a repeated index taking the largest of its values.

    Without a sort: a plain assignment leaves one of each index's values, then an unbuffered
    maximum brings in the others.
    """
    target[indices] = values
    if isinstance(target, np.ndarray):
        np.maximum.at(target, indices, values)
    else:
        target.scatter_reduce_(0, indices, values, "amax")


def count_distinct(values: Array) -> int:
    """How many distinct values the 1-d ``values`` holds (a host synchronisation on a device)."""
    if values.shape[0] == 0:
        return 0
    ordered: Array = np.sort(values) if isinstance(values, np.ndarray) else values.sort().values
    return int((ordered[1:] != ordered[:-1]).sum()) + 1


def full(shape: tuple[int, ...], value: float, dtype: torch.dtype, like: Array) -> Array:
    """A new array of ``shape`` filled with ``value``, of ``like``'s engine and device."""
    if isinstance(like, np.ndarray):
        return np.full(shape, value, dtype=_NUMPY_DTYPES[dtype])
    return torch.full(shape, value, dtype=dtype, device=like.device)


def arange(count: int, like: Array) -> Array:
    """``0 .. count - 1`` (int64) of ``like``'s engine and device."""
    if isinstance(like, np.ndarray):
        return np.arange(count, dtype=np.int64)
    return torch.arange(count, device=like.device)


def clip_rows(values: Array, low: int, high: Array) -> Array:
    """Each row of the 2-d ``values`` clamped into ``[low, high[row]]`` (a new array)."""
    if isinstance(values, np.ndarray):
        return np.clip(values, low, high[:, None])
    return torch.minimum(values.clamp_min(low), high[:, None])


def add_outer(rows: Array, columns: Array, out: Array) -> None:
    """``out[i, j] = rows[i] + columns[j]``, written into ``out``."""
    if isinstance(out, np.ndarray):
        np.add(rows[:, None], columns, out=out)
    else:
        torch.add(rows[:, None], columns, out=out)


def repeat_columns(values: Array, count: int) -> Array:
    """``[n, count]``: the 1-d ``values`` repeated along a new last axis (owned memory)."""
    if isinstance(values, np.ndarray):
        return np.repeat(values[:, None], count, axis=1)
    return values[:, None].expand(values.shape[0], count).contiguous()
