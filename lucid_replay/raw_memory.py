"""Raw memory access on int64 addresses, compiled (numba), which numba lacks.

``memcpy(target, source, count)`` copies ``count`` bytes (LLVM's memcpy: a 28 kB run several
times faster than an element loop); ``copy`` also moves the few bytes of one small record
inline; ``load_word`` / ``store_word``, ``load_int`` / ``store_int`` and ``load_byte`` /
``store_byte`` move an unaligned 8-byte, 4-byte and 1-byte unsigned integer;
``prefetch_read`` / ``prefetch_write`` hint that a cache line is about to be read or written
and ``prefetch_span`` that every line of a span is (LLVM's prefetch: never faults, changes
no byte). ``claim(address)`` adds one to the int64 at ``address`` atomically and returns
its value before (threads sharing work take turns by it); ``words(address, count)`` is the
``count`` int64 at ``address`` as an array, and ``address_of`` a C pointer as an int64.

Imported by `lucid_replay.ring_copies` only, so only where numba is there.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir  # type: ignore[import-untyped]  # no py.typed
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic
from numba.np.numpy_support import carray

from lucid_replay import engine

__all__: list[str] = []  # internal module

engine.available()  # numba is here: the functions below are compiled as they are registered
jit = engine.jit
pointer = cgutils.voidptr_t


def _memcpy(typing_context: Any, target: Any, source: Any, count: Any) -> Any:
    def generate(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        into, start, size = args
        cgutils.raw_memcpy(  # type: ignore[no-untyped-call]  # untyped in numba
            builder, builder.inttoptr(into, pointer), builder.inttoptr(start, pointer), size, 1
        )
        return context.get_dummy_value()

    return types.void(types.int64, types.int64, types.int64), generate


memcpy: Any = intrinsic(_memcpy)  # Any: numba's stubs type an intrinsic's call wrongly


def _access(bits: int) -> tuple[Any, Any]:
    """``load(address)`` and ``store(address, value)`` of a ``bits``-bit unsigned int."""
    kind = getattr(types, f"uint{bits}")
    typed = ir.IntType(bits).as_pointer()

    def load(typing_context: Any, address: Any) -> Any:
        def generate(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            return builder.load(builder.inttoptr(args[0], typed), align=1)

        return kind(types.int64), generate

    def store(typing_context: Any, address: Any, value: Any) -> Any:
        def generate(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            builder.store(args[1], builder.inttoptr(args[0], typed), align=1)
            return context.get_dummy_value()

        return types.void(types.int64, kind), generate

    return intrinsic(load), intrinsic(store)


def _claim(typing_context: Any, address: Any) -> Any:
    def generate(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        counter = builder.inttoptr(args[0], ir.IntType(64).as_pointer())
        return builder.atomic_rmw("add", counter, ir.Constant(ir.IntType(64), 1), "monotonic")

    return types.int64(types.int64), generate


def _words_pointer(typing_context: Any, address: Any) -> Any:
    def generate(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.inttoptr(args[0], ir.IntType(64).as_pointer())

    word_pointer = types.CPointer(types.int64)  # type: ignore[no-untyped-call]  # untyped in numba
    return word_pointer(types.int64), generate


def _address_of(typing_context: Any, value: Any) -> Any:
    def generate(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.ptrtoint(args[0], ir.IntType(64))

    return types.int64(types.voidptr), generate


claim: Any = intrinsic(_claim)
words_pointer: Any = intrinsic(_words_pointer)
address_of: Any = intrinsic(_address_of)

load_word, store_word = _access(64)
load_int, store_int = _access(32)
load_byte, store_byte = _access(8)


prefetch_read, prefetch_write = engine.prefetchers()


@jit
def copy(target: int, source: int, count: int) -> None:
    """``count`` bytes from address ``source`` to ``target``.

    A library memcpy for blocks; inline 8-byte and 1-byte moves for the few bytes of one
    record of a small field, where a memcpy call would cost several times the move.
    """
    if count >= 64:
        memcpy(target, source, count)
        return
    moved = 0
    while moved + 8 <= count:
        store_word(target + moved, load_word(source + moved))
        moved += 8
    while moved < count:
        store_byte(target + moved, load_byte(source + moved))
        moved += 1


@jit
def words(address: int, count: int) -> np.ndarray:
    """The ``count`` int64 at ``address``, as an array over that memory (no copy)."""
    return carray(words_pointer(address), (count,))


@jit
def prefetch_span(address: int, count: int) -> None:
    """Start the cache misses of every line of the ``count`` bytes at ``address``."""
    line = address - address % 64
    while line < address + count:
        prefetch_read(line)
        line += 64
