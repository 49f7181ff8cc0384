"""Checkpoints move data field by field through the ring: a save writes each field straight
from the ring's memory (two pieces where the stored transitions cross the ring's seam), a load
copies each field in, and files of the earlier layout (one tensor per field) still load bitwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (
    assert_batches_equal,
    both_engines,
    comparable,
    drive,
    filled_buffer,
    make_episode,
)

from lucid_replay import CheckpointError, PrioritizedSequenceReplay, SequenceReplay, checkpoint
from lucid_replay import files as checkpoint_files

_ROOT = Path(__file__).resolve().parents[1]


def _segmented(kind: type[SequenceReplay], **kwargs) -> SequenceReplay:
    """A segmented buffer whose ring has wrapped, with two episodes still open."""
    buffer = kind(capacity=30, segment_length=4, seed=2, **kwargs)
    rng = np.random.default_rng(3)
    streams = [buffer.open_episode() for _ in range(3)]
    for _ in range(25):
        steps = torch.arange(int(rng.integers(1, 7)))
        streams[int(rng.integers(3))].append({"x": steps, "y": steps[:, None] * torch.ones(3)})
    for stream in streams:
        stream.flush()
    streams[1].close(terminated=True)
    return buffer


def _prioritized() -> SequenceReplay:
    buffer = PrioritizedSequenceReplay(capacity=40, seed=4)
    buffer.extend(make_episode(length) for length in (9, 3, 7, 12, 5, 8, 2, 6))
    batch = buffer.sample_prioritized(4, 2)
    buffer.update_priorities(batch.indices, [0.5, 2.0, 0.25, 1.5])
    return buffer


_BUFFERS = {
    "wrapped": lambda: filled_buffer(),
    "unwrapped": lambda: filled_buffer(capacity=100),
    "empty": lambda: SequenceReplay(10, seed=1),
    "declared-empty": lambda: SequenceReplay(10, schema={"obs": ((2,), torch.float32)}),
    "prioritized": _prioritized,
    "segmented-open": lambda: _segmented(SequenceReplay),
    "prioritized-segments-open": lambda: _segmented(
        PrioritizedSequenceReplay, priority_unit="segment"
    ),
}


def _state(buffer: SequenceReplay) -> object:
    """The buffer's state dict for ``==``, its open streams' write tokens aside (a load
    resets them, so that no stream of the saved buffer writes into the loaded one)."""
    state = buffer.state_dict()
    episodes = state["table"].get("episodes")
    if episodes is not None:
        episodes["columns"]["token"].zero_()
    return comparable(state)


def _ring_span(buffer: SequenceReplay) -> tuple[int, int]:
    """The stored transitions' first ring slot and count."""
    table = buffer._core.store.table
    return table.oldest_offset % buffer.capacity, table.num_transitions


# -------------------------------------------------------------------------------- saving
def test_an_uncopied_state_is_the_rings_memory_in_one_or_two_exact_pieces() -> None:
    """Packed without copies, a field of a wrapped ring is two tensors over the ring's own
    memory (the slots up to the end, then from slot 0), each storage exactly its bytes."""
    buffer = filled_buffer()
    begin, stored = _ring_span(buffer)
    assert begin + stored > buffer.capacity  # the stored transitions cross the seam
    data = checkpoint.pack(buffer._snapshot(), copy=False)["data"]
    for name, ring_field in buffer._core.store.ring.fields.items():
        head, tail = data[name]
        row = ring_field[0].numel() * ring_field.element_size()
        assert (head.shape[0], tail.shape[0]) == (buffer.capacity - begin, stored - head.shape[0])
        assert head.data_ptr() == ring_field.data_ptr() + begin * row
        assert tail.data_ptr() == ring_field.data_ptr()
        assert [p.untyped_storage().nbytes() for p in (head, tail)] == [
            p.shape[0] * row for p in (head, tail)
        ]
    unwrapped = filled_buffer(capacity=100)
    data = checkpoint.pack(unwrapped._snapshot(), copy=False)["data"]
    assert all(isinstance(values, torch.Tensor) for values in data.values())


@pytest.mark.parametrize("case", ["wrapped", "unwrapped"])
def test_a_save_stores_the_bytes_the_one_tensor_layout_stored(tmp_path, case) -> None:
    """The file's pieces of each field, joined, are the state dict's tensor (what files of
    version 2 held), bit for bit; an unwrapped ring's fields are saved as one tensor each."""
    buffer = _BUFFERS[case]()
    buffer.save(tmp_path / "buffer.pt")
    saved = torch.load(tmp_path / "buffer.pt", weights_only=True)["data"]
    expected = buffer.state_dict()["data"]
    for name, values in saved.items():
        assert isinstance(values, list) == (case == "wrapped")
        joined = torch.cat(values) if isinstance(values, list) else values
        assert comparable(joined) == comparable(expected[name])


# ------------------------------------------------------------------------------ loading
@both_engines
@pytest.mark.parametrize("case", sorted(_BUFFERS))
def test_a_save_and_load_round_trips_bitwise_and_continues_exactly(tmp_path, case) -> None:
    """Every buffer kind (wrapped or not, prioritized, segmented with open episodes, empty)
    loads into the state it saved, bit for bit, and then draws what the saved one draws."""
    buffer = _BUFFERS[case]()
    buffer.save(tmp_path / "buffer.pt")
    loaded = type(buffer).load(tmp_path / "buffer.pt")
    assert _state(loaded) == _state(buffer)
    if len(buffer) and buffer.segment_length is None:
        for mine, theirs in zip(drive(loaded), drive(buffer), strict=True):
            assert_batches_equal(mine, theirs)
    elif len(buffer):
        assert torch.equal(loaded.sample(5, 2)["x"], buffer.sample(5, 2)["x"])


@both_engines
@pytest.mark.parametrize("case", ["wrapped", "prioritized", "segmented-open"])
def test_a_version_2_file_of_one_tensor_per_field_loads_bitwise(tmp_path, case) -> None:
    """A file in the earlier layout (version 2: each field one tensor, checksummed) loads
    into the state it holds and continues like the buffer it was taken from."""
    buffer = _BUFFERS[case]()
    state = {**buffer.state_dict(), "version": 2}
    assert all(isinstance(v, torch.Tensor) for v in state["data"].values())
    torch.save(checkpoint_files.sealed(state, checkpoint_files.feed_values), tmp_path / "v2.pt")
    loaded = type(buffer).load(tmp_path / "v2.pt")
    assert _state(loaded) == _state(buffer)
    assert_batches_equal(loaded.sample(6, 2), buffer.sample(6, 2))


def test_the_checksum_encoding_is_the_one_earlier_files_carry() -> None:
    """The checksum of a fixed payload is the digest version 2 files were written with, so
    that their checksums still verify."""
    payload = {
        "format": "lucid_replay.buffer",
        "version": 2,
        "data": {
            "obs": torch.tensor([[0.0, 1.0], [2.0, 3.0]]),
            "serial": torch.tensor([100, 101]),
            "done": torch.tensor([False, True]),
        },
        "entries": [1, 2.5, None, "a", True, (3, 4)],
        "checksum": "not covered",
    }
    assert checkpoint_files.checksum(payload, checkpoint_files.feed_values) == (
        "0abd580e010fbba00710442f84139511b9e540844ac0ccbd59ac390b544c9255"
    )


@pytest.mark.parametrize(
    ("pieces", "message"),
    [
        (lambda obs: [obs[:10], obs[11:]], r"must have shape \(18, 2\), got \(10, 2\) \+ \(7, 2\)"),
        (
            lambda obs: [obs[:10], obs[10:, :1]],
            r"must have shape \(18, 2\), got \(10, 2\) \+ \(8, 1\)",
        ),
        (lambda obs: [obs[:10], obs[10:].double()], "must be a torch.float32 tensor, got a"),
        (lambda obs: [obs[:10], obs[10:].tolist()], "must be a torch.float32 tensor, got a list"),
        (lambda obs: [], "must be a torch.float32 tensor, got a list"),
    ],
    ids=["short", "other-per-step-shape", "other-dtype", "not-a-tensor", "no-pieces"],
)
def test_pieces_that_are_not_the_stored_data_are_refused(pieces, message) -> None:
    """A field's pieces must be tensors of its dtype and per-step shape whose lengths add up
    to the stored transitions; otherwise the state is refused and the buffer unchanged."""
    source = filled_buffer(capacity=40, lengths=(5, 6, 7))
    state = source.state_dict()
    state["data"]["obs"] = pieces(state["data"]["obs"])
    target = filled_buffer(capacity=40, lengths=(4, 4))
    before = comparable(target.state_dict())
    with pytest.raises(CheckpointError, match=f"checkpoint data 'obs' {message}"):
        target.load_state_dict(state)
    assert comparable(target.state_dict()) == before


def test_a_state_of_pieces_loads_like_its_joined_tensors() -> None:
    """A state whose fields are lists of pieces (any split) loads as the joined state does."""
    source = filled_buffer(capacity=40, lengths=(5, 6, 7))
    state = source.state_dict()
    split = {**state, "data": {k: list(v.split([1, 9, 8])) for k, v in state["data"].items()}}
    loaded = SequenceReplay(40, seed=5)
    loaded.load_state_dict(split)
    assert comparable(loaded.state_dict()) == comparable(state)


# ------------------------------------------------------------------------------- memory
@pytest.mark.skipif(
    not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux's peak-RSS reset"
)
def test_a_save_adds_far_less_than_the_stored_bytes_to_peak_memory() -> None:
    """Saving a full, wrapped 200 MB buffer raises a fresh process's peak RSS by well under
    the stored bytes (it writes from the ring: copying the data first added 1x)."""
    command = [sys.executable, "-m", "benchmarks.tools.save_memory", "--json", "--save-only"]
    done = subprocess.run(
        [*command, "--megabytes", "200"],
        cwd=_ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(result["package"]) == _ROOT / "lucid_replay"
    assert result["stored_bytes"] > 190 * 2**20
    assert result["save_added_bytes"] < 0.5 * result["stored_bytes"]
