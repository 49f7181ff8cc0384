"""Batches and what flows back from them (SPEC sections 2-4): `WindowBatch` / `Batch` /
`PrioritizedBatch` structure and device moves, priority routing (`update_priorities_from`),
stored-state write-back, the prefetching iterator, and CUDA paths (skipped without a GPU).

The standard buffer holds episodes of lengths [4, 2, 6] (ids 0, 1, 2; the second terminated)
whose steps carry serials ``100 * (id + 1) + step``. The anchors and the window are those of
the hand-computed tables in test_window.py; the record layouts used here are repeated in the
comments.
"""

from __future__ import annotations

import pytest
import torch
from conftest import (
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
)

from lucid_replay import (
    Batch,
    InvalidArgumentError,
    PrioritizedBatch,
    PrioritizedSequenceReplay,
    SchemaDtypeError,
    SequenceReplay,
    Window,
    WindowBatch,
)

pytestmark = pytest.mark.usefixtures("index_engine")  # numpy and torch index arithmetic


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


# ------------------------------------------------------------------------- write_back

# pad records of the anchors (2, 1), (0, 3), (1, 0), (2, 4):
#   (2, 1): steps [0, 0, 1, 3, 5], valid [F, F, T, T, T]
#   (0, 3): steps [0, 1, 3, 3, 3], valid [F, T, T, F, F]
#   (1, 0): steps [0, 0, 0, 1, 1], valid [F, F, T, F, F]
#   (2, 4): steps [0, 2, 4, 5, 5], valid [T, T, T, F, F]
# values = 9000 + 5 b + k.
WRITE_IDS = [2, 0, 1, 2]
WRITE_STEPS = [1, 3, 0, 4]


def _write_values(batch_size=4, window_size=5):
    return 9000 + torch.arange(batch_size * window_size, dtype=torch.int64).reshape(
        batch_size, window_size
    )


def test_write_back_writes_valid_records_only():
    """Values land at valid records' (episode, step); invalid (clamped) records are skipped."""
    buffer = standard_buffer()
    batch = buffer.gather_windows(WRITE_IDS, WRITE_STEPS, Window(**TABLE_WINDOW))
    obs_before = [buffer[e]["obs"].clone() for e in range(3)]
    assert buffer.write_back(batch, "serial", _write_values()) == 9
    assert stored(buffer, 0) == [100, 9006, 102, 9007]
    assert stored(buffer, 1) == [9012, 201]  # step 1 only reached by invalid records
    assert stored(buffer, 2) == [9015, 9002, 9016, 9003, 9017, 9004]
    for e in range(3):
        assert torch.equal(buffer[e]["obs"], obs_before[e])


def test_write_back_with_include_reset_writes_records_of_neighbouring_episodes():
    """Valid include_reset records in other episodes are written at their own (episode, step)."""
    buffer = standard_buffer()
    # Anchor (1, 0): records ep 0 s0, ep 0 s2, ep 1 s0, ep 2 s0, ep 2 s2, all valid.
    batch = buffer.gather_windows([1], [0], Window(**TABLE_WINDOW, boundary="include_reset"))
    values = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0], [9.0, 10.0]]])
    assert buffer.write_back(batch, "obs", values) == 5
    assert buffer[0]["obs"].tolist() == [[1.0, 2.0], [101.0, -101.0], [3.0, 4.0], [103.0, -103.0]]
    assert buffer[1]["obs"].tolist() == [[5.0, 6.0], [201.0, -201.0]]
    assert buffer[2]["obs"][:3].tolist() == [[7.0, 8.0], [301.0, -301.0], [9.0, 10.0]]


def test_write_back_skips_episodes_evicted_since_the_draw():
    """Records of evicted episodes are skipped, uncounted; their slots' new owner is untouched."""
    buffer = standard_buffer(capacity=12)
    batch = buffer.gather_windows([0, 2], [1, 2], Window(2, burn_in=1))
    # (0, 1): steps 0, 1, 2 valid; (2, 2): steps 1, 2, 3 valid.
    newcomer = buffer.add(make_episode(4, first_serial=500))  # takes episode 0's ring slots
    assert list(buffer.episode_ids) == [1, 2, 3]
    values = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int64)
    assert buffer.write_back(batch, "serial", values) == 3
    assert stored(buffer, newcomer) == [500, 501, 502, 503]
    assert stored(buffer, 2) == [300, 4, 5, 6, 304, 305]
    assert stored(buffer, 1) == [200, 201]


def test_write_back_stores_values_not_an_autograd_graph():
    """Values computed with grad are stored as data: later batches do not require grad."""
    buffer = standard_buffer(seed=0)
    batch = buffer.gather_windows(WRITE_IDS, WRITE_STEPS, Window(**TABLE_WINDOW))
    scale = torch.tensor(2.0, requires_grad=True)
    assert buffer.write_back(batch, "obs", batch["obs"] * scale) == 9
    assert buffer[0]["obs"][1].tolist() == [202.0, -202.0]
    assert not buffer[0]["obs"].requires_grad
    assert not buffer.sample(4, 2)["obs"].requires_grad


@pytest.mark.parametrize(
    ("name", "values", "error", "message"),
    [
        (
            "serial",
            torch.zeros(4, 5, dtype=torch.float32),
            SchemaDtypeError,
            r"^values must have dtype torch\.int64, got torch\.float32$",
        ),
        (
            "serial",
            torch.zeros(4, 4, dtype=torch.int64),
            InvalidArgumentError,
            r"^values must be of shape \(4, 5\), got \(4, 4\)$",
        ),
        (
            "obs",
            torch.zeros(4, 5, dtype=torch.float32),
            InvalidArgumentError,
            r"^values must be of shape \(4, 5, 2\), got \(4, 5\)$",
        ),
        (
            "hidden",
            torch.zeros(4, 5),
            InvalidArgumentError,
            r"^name must be a stored field \['done', 'obs', 'serial'\], got 'hidden'$",
        ),
        (
            "serial",
            [[0] * 5] * 4,
            TypeError,
            r"^values must be a torch\.Tensor, got list$",
        ),
    ],
)
def test_write_back_refuses_bad_values_and_changes_nothing(name, values, error, message):
    """Wrong dtype -> TypeError; wrong shape or unknown field -> ValueError; nothing written."""
    buffer = standard_buffer()
    batch = buffer.gather_windows(WRITE_IDS, WRITE_STEPS, Window(**TABLE_WINDOW))
    with pytest.raises(error, match=message) as caught:
        buffer.write_back(batch, name, values)
    builtin = TypeError if error in (SchemaDtypeError, TypeError) else ValueError
    assert isinstance(caught.value, builtin)
    assert stored(buffer, 0) == [100, 101, 102, 103]
    assert stored(buffer, 2) == [300, 301, 302, 303, 304, 305]


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

    pad = buffer.gather_windows(WRITE_IDS, WRITE_STEPS, Window(**TABLE_WINDOW))
    assert buffer.write_back(pad, "serial", _write_values().cuda()) == 9
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


def test_write_back_into_a_chunk_batch():
    """`write_back` accepts a chunk `Batch`: every record is valid, evicted episodes are
    skipped (old: AttributeError)."""
    buffer = SequenceReplay(capacity=20, seed=0)
    buffer.extend(make_episode(8, first_serial=100 * i) for i in range(2))
    batch = buffer.sample(3, 4)
    values = torch.stack([-batch["serial"], batch["serial"]], dim=2).to(torch.float32)
    assert buffer.write_back(batch, "obs", values) == 12
    for row in range(3):
        episode = buffer[int(batch.episode_ids[row])]
        start = int(batch.starts[row])
        assert torch.equal(episode["obs"][start : start + 4], values[row])
    buffer.add(make_episode(8))  # evicts episode 0
    written = int((batch.episode_ids != 0).sum()) * 4
    assert buffer.write_back(batch, "obs", values) == written


def test_write_back_refuses_what_is_not_a_batch():
    """`write_back` of something that is not a batch is our `TypeError`."""
    buffer = SequenceReplay(capacity=20, seed=0)
    buffer.add(make_episode(8))
    with pytest.raises(TypeError, match="batch must be a Batch or WindowBatch"):
        buffer.write_back({"obs": torch.zeros(1)}, "obs", torch.zeros(1, 1, 2))
