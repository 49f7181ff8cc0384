"""Transparent huge pages for the ring's CPU fields: asked for where they fit, never a failure.

The kernel's answer is read back from ``/proc/self/smaps`` (the ``hg`` flag of the mapping),
so these tests fail if the ring stops asking, or asks for the wrong range.
"""

from __future__ import annotations

import mmap
import platform
import sys
from pathlib import Path

import pytest
import torch

from lucid_replay import Episode, SequenceReplay, hugepages
from lucid_replay.allocators import MEMORY
from lucid_replay.ring import TransitionRing

_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_thp_available = (
    sys.platform.startswith("linux")
    and _THP.exists()
    and "[never]" not in _THP.read_text()
    and hugepages._madvise() is not None
)
needs_thp = pytest.mark.skipif(not _thp_available, reason="no transparent huge pages here")


def _huge_page_inside(tensor: torch.Tensor) -> int:
    size = hugepages._madvise()[3]  # type: ignore[index]
    return -(-tensor.data_ptr() // size) * size


def _mapping_at(address: int) -> dict[str, str]:
    """The ``smaps`` fields of the mapping that holds ``address`` in this process."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for index, line in enumerate(lines):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            low, high = (int(x, 16) for x in head.split("-"))
            if low <= address < high:
                fields = {}
                for entry in lines[index + 1 :]:
                    name, _, value = entry.partition(":")
                    if not value or " " in name:
                        break
                    fields[name] = value.strip()
                return fields
    raise AssertionError(f"no mapping holds {address:#x}")


def _flags_at(address: int) -> set[str]:
    """The ``VmFlags`` of the mapping that holds ``address`` in this process."""
    return set(_mapping_at(address)["VmFlags"].split())


def _kernel_collapses() -> bool:
    """``MADV_COLLAPSE`` exists from Linux 6.1 on."""
    release = platform.release().split(".")
    try:
        return (int(release[0]), int(release[1])) >= (6, 1)
    except (ValueError, IndexError):
        return False


@needs_thp
def test_a_large_ring_field_asks_for_huge_pages_before_its_first_write() -> None:
    """A ring field spanning whole huge pages is advised (its mapping shows the hg flag);
    one smaller than a huge page is left alone."""
    ring = TransitionRing(1 << 20, torch.device("cpu"), MEMORY)
    ring.allocate({"obs": ((8,), torch.float32), "flag": ((), torch.bool)})
    obs = ring.fields["obs"]  # 32 MiB: whole huge pages inside
    assert "hg" in _flags_at(_huge_page_inside(obs))
    flag = ring.fields["flag"]  # 1 MiB: smaller than a huge page, left alone
    assert hugepages.advise(flag) is False


@needs_thp
def test_a_buffer_samples_the_same_data_from_advised_memory() -> None:
    """A buffer whose ring is on advised memory stores and returns the same data."""
    buffer = SequenceReplay(1 << 19, seed=0)
    obs = torch.arange(600 * 16, dtype=torch.float32).reshape(600, 16)
    buffer.add(Episode({"obs": obs}))
    store = buffer._core.store.ring.fields["obs"]  # 32 MiB of obs
    assert "hg" in _flags_at(_huge_page_inside(store))
    assert torch.equal(buffer[0]["obs"], obs)


def test_advice_is_skipped_for_small_and_non_cpu_tensors() -> None:
    """Tensors smaller than a huge page, or not on the CPU, get no advice."""
    assert hugepages.advise(torch.empty(16)) is False
    assert hugepages.advise(torch.empty(1 << 22, device="meta")) is False


def test_without_madvise_a_ring_is_allocated_and_nothing_is_advised(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the C library has no madvise, rings allocate as usual and nothing is advised."""
    monkeypatch.setattr(hugepages, "_madvise", lambda: None)
    ring = TransitionRing(1 << 20, torch.device("cpu"), MEMORY)
    ring.allocate({"obs": ((8,), torch.float32)})
    assert hugepages.advise(ring.fields["obs"]) is False
    assert ring.fields["obs"].shape == (1 << 20, 8)


def test_a_refused_advice_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refused madvise returns False (no error, no collapse), and the advice covered
    exactly the whole huge pages inside the tensor."""
    calls: list[tuple[int, int, int]] = []

    def refuse(start: int, length: int, advice: int) -> int:
        calls.append((start, length, advice))
        return -1  # as madvise does with EINVAL where the kernel has no THP

    size = 2 * 2**20
    monkeypatch.setattr(hugepages, "_madvise", lambda: (refuse, 14, 25, size))
    tensor = torch.empty(4 * size // 4, dtype=torch.float32)  # 8 MiB
    assert hugepages.advise(tensor) is False
    [(start, length, advice)] = calls  # refused: no collapse asked for either
    begin, end = tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * 4
    assert start % size == 0 and length % size == 0 and length > 0
    assert begin <= start and start + length <= end  # only whole pages inside the tensor
    assert start - begin < size and end - (start + length) < size  # and all of them
    assert advice == 14


@needs_thp
@pytest.mark.skipif(not _kernel_collapses(), reason="MADV_COLLAPSE needs Linux 6.1")
def test_memory_faulted_in_before_the_advice_is_collapsed_into_huge_pages() -> None:
    """Heap memory that an allocator hands back has its pages mapped already, where the
    advice alone leaves 4 KiB pages: the ring's field must end up on huge pages anyway."""
    # Memory of our own, faulted in on 4 KiB pages: a heap block could be one that earlier
    # tests in this process advised and collapsed already.
    memory = mmap.mmap(-1, 12 * 2**20, flags=mmap.MAP_PRIVATE)  # anonymous, not shmem
    memory.madvise(mmap.MADV_NOHUGEPAGE)
    tensor = torch.frombuffer(memory, dtype=torch.uint8)
    tensor.fill_(1)  # faulted in without the advice: 4 KiB pages
    inside = _huge_page_inside(tensor)
    assert _mapping_at(inside)["AnonHugePages"] == "0 kB"
    assert hugepages.advise(tensor) is True
    assert "hg" in _flags_at(inside)
    mapping = _mapping_at(inside)
    # Every whole huge page inside the tensor is huge now. The mapping may also hold the
    # 4 KiB pages of an unaligned head and tail (Rss larger, by chance of the allocation).
    size = 2 * 2**20
    begin, end = tensor.data_ptr(), tensor.data_ptr() + tensor.numel()
    whole = (end // size - (begin + size - 1) // size) * size // 1024
    huge, resident = (int(mapping[key].split()[0]) for key in ("AnonHugePages", "Rss"))
    assert whole >= 5 * 2048 and whole <= huge <= resident
    assert bool((tensor == 1).all())  # the collapse copied the contents


def test_no_collapse_is_asked_for_where_huge_pages_are_turned_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The collapse follows the advice only where huge pages are not turned off."""
    calls: list[int] = []

    def accept(start: int, length: int, advice: int) -> int:
        calls.append(advice)
        return 0

    size = 2 * 2**20
    monkeypatch.setattr(hugepages, "_madvise", lambda: (accept, 14, 25, size))
    assert hugepages.advise(torch.empty(2 * size, dtype=torch.uint8)) is True
    assert calls == [14, 25]
    calls.clear()
    monkeypatch.setattr(hugepages, "_madvise", lambda: (accept, 14, None, size))
    assert hugepages.advise(torch.empty(2 * size, dtype=torch.uint8)) is True
    assert calls == [14]
