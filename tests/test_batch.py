"""Batches: `WindowBatch` / `Batch` / `PrioritizedBatch` structure and device moves, the memory
every batch owns, and the CUDA paths (skipped without a GPU).

Tests use the standard buffer (`conftest.standard_buffer`): episodes of lengths [4, 2, 6] (ids
0, 1, 2; the second terminated) whose steps carry serials ``100 * (id + 1) + step``. The
anchors and the window are those of the hand-computed tables in test_window.py; the record
layouts used here are repeated in the comments.
"""

from __future__ import annotations

from collections.abc import Mapping, ValuesView

import pytest
import torch
from conftest import (
    ANCHOR_IDS,
    ANCHOR_STEPS,
    ROUTING_ERRORS,
    ROUTING_IDS,
    ROUTING_STEPS,
    TABLE_WINDOW,
    F,
    T,
    cuda,
    make_episode,
    standard_buffer,
    stored,
    write_values,
)

import lucid_replay.batch_memory
from lucid_replay import (
    Batch,
    PrioritizedBatch,
    PrioritizedSequenceReplay,
    SequenceReplay,
    Window,
    WindowBatch,
)

pytestmark = pytest.mark.usefixtures("index_engine")  # every engine of the index arithmetic


# The [B, W] entries of a WindowBatch besides its data.
PER_RECORD = (
    "learning_mask",
    "validity_mask",
    "is_init",
    "terminal",
    "record_episode_ids",
    "record_steps",
    "step_in_sequence",
)


# ------------------------------------------------------------------ WindowBatch structure


def test_window_batch_getitem_is_the_data_field():
    """batch[name] is batch.data[name], [B, W, *field_shape]."""
    buffer = standard_buffer()
    batch = buffer.gather_windows([0, 2], [1, 3], Window(2, burn_in=1))
    for name in ("serial", "obs", "done"):
        assert batch[name] is batch.data[name]
    assert tuple(batch["obs"].shape) == (2, 3, 2)
    with pytest.raises(KeyError):
        batch["missing"]


def test_window_batch_flat_keys_shapes_and_sequence_id():
    """flat() holds every data field, every per-record entry and sequence_id, all [B*W, ...]."""
    buffer = standard_buffer()
    batch = buffer.gather_windows(
        [2, 0, 1], [1, 3, 0], Window(**TABLE_WINDOW, boundary="include_reset")
    )
    flat = batch.flat()
    assert set(flat) == {"serial", "obs", "done", *PER_RECORD, "sequence_id"}
    for name, value in flat.items():
        assert value.shape[0] == 15, name
    assert tuple(flat["obs"].shape) == (15, 2)
    assert flat["sequence_id"].dtype == torch.int64
    assert flat["sequence_id"].tolist() == [0] * 5 + [1] * 5 + [2] * 5
    assert flat["step_in_sequence"].tolist() == [0, 1, 2, 3, 4] * 3
    assert flat["serial"].tolist() == [
        *(103, 201, 301, 303, 305),
        *(100, 101, 103, 201, 301),
        *(100, 102, 200, 300, 302),
    ]
    assert flat["validity_mask"].tolist() == [T] * 5 + [F, T, T, T, T] + [T] * 5
    for name in ("learning_mask", "is_init", "terminal", "record_episode_ids", "record_steps"):
        assert torch.equal(flat[name], getattr(batch, name).reshape(15)), name


def test_window_batch_to_cpu_returns_equal_tensors():
    """to('cpu') returns a WindowBatch whose every tensor equals the original; weights kept."""
    buffer = standard_buffer(PrioritizedSequenceReplay, seed=0)
    for batch in (
        buffer.gather_windows([0, 2], [1, 3], Window(2, burn_in=1)),
        buffer.sample_windows(4, Window(2, burn_in=1)),
    ):
        moved = batch.to("cpu", non_blocking=True)
        assert isinstance(moved, WindowBatch)
        for name in (*PER_RECORD, "episode_ids", "anchor_steps"):
            assert torch.equal(getattr(moved, name), getattr(batch, name)), name
        assert set(moved.data) == set(batch.data)
        for name in batch.data:
            assert torch.equal(moved[name], batch[name]), name
        if batch.weights is None:
            assert moved.weights is None
        else:
            assert torch.equal(moved.weights, batch.weights)


def test_batch_and_prioritized_batch_to_keep_their_class_and_values():
    """Batch.to and PrioritizedBatch.to return the same class with equal tensors."""
    buffer = standard_buffer(PrioritizedSequenceReplay, seed=3)
    uniform = buffer.sample(5, 2)
    assert type(uniform) is Batch
    moved = uniform.to("cpu")
    assert type(moved) is Batch
    assert torch.equal(moved.episode_ids, uniform.episode_ids)
    assert torch.equal(moved.starts, uniform.starts)
    assert torch.equal(moved["obs"], uniform["obs"])
    assert moved["serial"] is moved.data["serial"]

    prioritized = buffer.sample_prioritized(5, 2)
    assert type(prioritized) is PrioritizedBatch
    moved = prioritized.to("cpu", non_blocking=True)
    assert type(moved) is PrioritizedBatch
    for name in ("episode_ids", "starts", "indices", "weights"):
        assert torch.equal(getattr(moved, name), getattr(prioritized, name)), name
    assert torch.equal(moved["serial"], prioritized["serial"])
    assert torch.equal(prioritized.indices, prioritized.episode_ids)


@pytest.mark.parametrize("recycled", ["out", "recycle"])
def test_to_the_same_device_is_a_copy_that_a_later_draw_leaves_alone(recycled):
    """batch.to(its own device) copies every tensor: kept past `out=` or `recycle=True`,
    the copy still holds the draw it was made from."""
    buffer = PrioritizedSequenceReplay(500, seed=0)
    buffer.extend(make_episode(30, first_serial=100 * i) for i in range(10))
    window = Window(3, burn_in=1)
    stream = buffer.iterate(4, window, prefetch=1, recycle=True) if recycled == "recycle" else None
    batch = next(stream) if stream is not None else buffer.sample_windows(4, window)
    kept = batch.to("cpu")
    tensors = {"serial": batch["serial"], **{n: getattr(batch, n) for n in PER_RECORD}}
    copies = {"serial": kept["serial"], **{n: getattr(kept, n) for n in PER_RECORD}}
    for name, tensor in tensors.items():
        assert copies[name].untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr()
    expected = {name: tensor.tolist() for name, tensor in copies.items()}
    for _ in range(6):
        if stream is not None:
            next(stream)
        else:
            buffer.sample_windows(4, window, out=batch)
    if stream is not None:
        stream.close()
    assert {name: tensor.tolist() for name, tensor in copies.items()} == expected
    assert not torch.equal(batch["serial"], kept["serial"])  # the batch itself was drawn into
    chunks = buffer.sample_prioritized(4, 2)
    moved = chunks.to("cpu")
    for name in ("episode_ids", "starts", "indices", "weights"):
        assert getattr(moved, name).data_ptr() != getattr(chunks, name).data_ptr(), name


# ------------------------------------------------------------------------------ CUDA


@cuda
def test_cpu_storage_to_cuda_target_gives_cuda_tensors_equal_to_the_cpu_draw():
    """CPU storage, device='cuda': sample / sample_windows / gather_windows land on CUDA."""
    on_cpu = standard_buffer(PrioritizedSequenceReplay, seed=9)
    to_cuda = standard_buffer(PrioritizedSequenceReplay, seed=9)
    window = Window(2, burn_in=2, bootstrap=1, dilation=2, boundary="include_reset")

    expected, got = on_cpu.sample(6, 2), to_cuda.sample(6, 2, device="cuda")
    assert got["obs"].is_cuda and got.episode_ids.is_cuda
    assert torch.equal(got["obs"].cpu(), expected["obs"])

    expected, got = on_cpu.sample_prioritized(6, 2), to_cuda.sample_prioritized(6, 2, device="cuda")
    assert got.weights.is_cuda and got.indices.is_cuda
    assert torch.equal(got.weights.cpu(), expected.weights)

    expected = on_cpu.sample_windows(6, window)
    got = to_cuda.sample_windows(6, window, device="cuda")
    torch.cuda.synchronize()
    for name in ("validity_mask", "is_init", "terminal", "record_episode_ids", "anchor_steps"):
        assert getattr(got, name).is_cuda, name
        assert torch.equal(getattr(got, name).cpu(), getattr(expected, name)), name
    for name in ("serial", "obs", "done"):
        assert got[name].is_cuda
        assert torch.equal(got[name].cpu(), expected[name]), name
    assert got.weights.is_cuda

    gathered = to_cuda.gather_windows([2, 0], [1, 3], window, device="cuda")
    assert gathered["serial"].is_cuda
    assert gathered["serial"].cpu().tolist() == [
        [103, 201, 301, 303, 305],
        [100, 101, 103, 201, 301],
    ]
    moved = gathered.to("cpu")
    assert not moved["serial"].is_cuda
    assert moved.to("cuda", non_blocking=True)["serial"].is_cuda


@cuda
def test_cuda_storage_end_to_end():
    """Storage on CUDA: sample, sample_windows, update_priorities_from and write_back all work."""
    buffer = standard_buffer(PrioritizedSequenceReplay, epsilon=0.25, seed=0, device="cuda")
    assert buffer.device.type == "cuda"
    chunks = buffer.sample(4, 2)
    assert chunks["obs"].is_cuda and chunks.starts.is_cuda
    sampled = buffer.sample_windows(8, Window(2, burn_in=1))
    assert sampled["obs"].is_cuda and sampled.weights.is_cuda

    batch = buffer.gather_windows(
        ROUTING_IDS, ROUTING_STEPS, Window(**TABLE_WINDOW, boundary="include_reset")
    )
    assert batch.record_episode_ids.is_cuda
    errors = torch.tensor(ROUTING_ERRORS, device="cuda")
    assert buffer.update_priorities_from(batch, errors, eta=0.75) == 3
    assert buffer.priorities.cpu().tolist() == [0.75, 1.75, 4.25]

    pad = buffer.gather_windows(ANCHOR_IDS, ANCHOR_STEPS, Window(**TABLE_WINDOW))
    assert buffer.write_back(pad, "serial", write_values().cuda()) == 9
    assert stored(buffer, 0) == [100, 9006, 102, 9007]
    assert stored(buffer, 2) == [9015, 9002, 9016, 9003, 9017, 9004]

    batches = buffer.iterate(2, Window(1))
    try:
        assert next(batches)["serial"].is_cuda
    finally:
        batches.close()


# ----------------------------------------------------------------------- memory ownership


def test_window_batches_own_their_per_record_entries():
    """Writing into one batch's masks or steps changes no later batch of any buffer, and
    whole-column writes work (old: shared cache memory; ``[:, k] = False`` raised)."""
    first, second = SequenceReplay(100, seed=0), SequenceReplay(100, seed=1)
    for buffer in (first, second):
        buffer.extend(make_episode(12) for _ in range(3))
    window = Window(4, burn_in=2, bootstrap=1)
    batch = first.sample_windows(8, window)
    batch.learning_mask[:, 2] = False
    batch.learning_mask[0, 4] = False
    batch.step_in_sequence[0, 0] = 99
    batch.record_episode_ids[:, 0] = -7
    batch.validity_mask[:, 1] = False
    for later in (first.sample_windows(8, window), second.sample_windows(8, window)):
        assert later.learning_mask.tolist() == [window.learning_mask.tolist()] * 8
        assert later.step_in_sequence.tolist() == [list(range(window.size))] * 8
        assert (later.record_episode_ids >= 0).all()
    for tensor in (batch.learning_mask, batch.step_in_sequence, batch.record_episode_ids):
        assert tensor.is_contiguous()


def test_chunk_batches_own_their_memory():
    """Writing into a chunk batch changes neither storage nor a later batch."""
    buffer = SequenceReplay(100, seed=0)
    buffer.add(make_episode(6, first_serial=0))
    batch = buffer.sample(4, 6)
    batch["serial"][:] = -1
    batch.starts[:] = 3
    assert buffer[0]["serial"].tolist() == list(range(6))
    assert buffer.sample(4, 6).starts.tolist() == [0, 0, 0, 0]


@pytest.mark.skipif(lucid_replay.batch_memory._use_count is None, reason="torch lacks a use count")
def test_batch_memory_is_reused_only_once_nothing_refers_to_it():
    """A dropped batch's block serves a later draw (no allocation, no page faults); a batch,
    a view of one of its tensors, or a numpy array of it keeps its memory from reuse."""
    buffer = PrioritizedSequenceReplay(500, seed=0)
    buffer.extend(make_episode(40, first_serial=100 * i) for i in range(6))
    window = Window(5, burn_in=3, bootstrap=1)

    def address(batch):
        return batch.data["serial"].untyped_storage().data_ptr()

    first = buffer.sample_windows(16, window)
    kept = address(first)
    del first
    again = buffer.sample_windows(16, window)
    assert address(again) == kept  # reused: nothing referred to it

    for hold in (
        lambda batch: batch,
        lambda batch: batch.data["serial"][:, 2:],
        lambda batch: batch.validity_mask.numpy(),
        lambda batch: batch.weights,
        lambda batch: batch.data["serial"],  # the very tensor object the batch holds
        lambda batch: batch.data,  # its mapping, which holds that tensor
        lambda batch: dict(batch.data),
        lambda batch: batch.data.values(),  # a view of the dict behind the mapping
        lambda batch: batch.record_steps,
        lambda batch: batch.data["serial"].untyped_storage(),  # the memory, by its storage
    ):
        batch = buffer.sample_windows(16, window)
        held = hold(batch)
        expected = _values(held)
        del batch
        for _ in range(2 * lucid_replay.batch_memory.KEPT):
            buffer.sample_windows(16, window)  # every kept block is drawn into, if free
            buffer.sample_windows(16, Window(2))  # a block of another size in between
        assert _values(held) == expected


def _values(held):
    if isinstance(held, WindowBatch):
        return [held.data["serial"].tolist(), held.record_steps.tolist(), held.weights.tolist()]
    if isinstance(held, Mapping):
        return {name: values.tolist() for name, values in held.items()}
    if isinstance(held, ValuesView):
        return [values.tolist() for values in held]
    if isinstance(held, torch.UntypedStorage):
        return torch.empty(0, dtype=torch.uint8).set_(held).tolist()
    return held.tolist()


@pytest.mark.skipif(lucid_replay.batch_memory._use_count is None, reason="torch lacks a use count")
def test_a_dropped_batch_is_drawn_into_again_as_it_was_built():
    """A batch nobody holds is handed out again, views and all, holding the new draw; one of
    another layout on the same block is built anew."""
    buffer = PrioritizedSequenceReplay(500, seed=0)
    buffer.extend(make_episode(40, first_serial=100 * i) for i in range(6))
    window = Window(5, burn_in=3, bootstrap=1)
    first = buffer.sample_windows(16, window)
    identity, serials = id(first), first.data["serial"].clone()
    del first
    again = buffer.sample_windows(16, window)
    assert id(again) == identity  # the same object, filled by the new draw
    assert not torch.equal(again.data["serial"], serials)
    assert torch.equal(again.data["serial"], again.record_steps + 100 * again.record_episode_ids)
    del again
    uniform = buffer.sample_windows(16, window, prioritized=False)  # no weights: another layout
    assert uniform.weights is None and id(uniform) != identity


def test_without_exact_reference_counts_no_batch_memory_is_reused(monkeypatch):
    """Where reference counts are not exact (free-threaded Python), a holder of a batch's
    storage could not be seen: every draw gets new memory, and a held batch keeps its values."""
    monkeypatch.setattr(lucid_replay.batch_memory, "_exact_refcounts", False)
    buffer = SequenceReplay(200, seed=0)
    buffer.extend(make_episode(20, first_serial=100 * i) for i in range(3))
    storage = buffer.sample_windows(8, Window(3)).data["serial"].untyped_storage()
    expected = torch.empty(0, dtype=torch.uint8).set_(storage).tolist()
    for _ in range(2 * lucid_replay.batch_memory.KEPT):
        buffer.sample_windows(8, Window(3))
    assert buffer._core.batcher.blocks._kept == []
    assert torch.empty(0, dtype=torch.uint8).set_(storage).tolist() == expected


def test_without_a_storage_use_count_no_batch_memory_is_kept(monkeypatch):
    """Where torch lacks the private use-count function, no block is remembered for reuse
    (nothing could tell when a batch is free), and draws still work."""
    monkeypatch.setattr(lucid_replay.batch_memory, "_use_count", None)
    buffer = SequenceReplay(200, seed=0)
    buffer.extend(make_episode(20, first_serial=100 * i) for i in range(3))
    for _ in range(3):
        batch = buffer.sample_windows(8, Window(3))
        assert batch.data["serial"].shape == (8, 3)
        del batch
    assert buffer._core.batcher.blocks._kept == []
