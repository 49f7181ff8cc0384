"""Frame-stacked fields (`Field(..., stack=k)`): one frame stored per step, ``k`` gathered.

Every gathered batch is checked against a reference built from ``buffer[id]`` (the stored
frames), on every engine, on whole-episode and segmented buffers (heads evicted included).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from conftest import assert_refused
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lucid_replay import (
    CheckpointError,
    Episode,
    Field,
    InvalidArgumentError,
    InvalidTypeError,
    PrioritizedSequenceReplay,
    SequenceReplay,
    Window,
    engine,
)

FRAME = (3, 2)


def frames_of(serial: int, length: int) -> torch.Tensor:
    """``length`` uint8 frames ``[3, 2]``, all different (frame ``t`` starts at ``serial + t``)."""
    base = torch.arange(math.prod(FRAME), dtype=torch.int64).view(FRAME) * 7
    steps = torch.arange(length, dtype=torch.int64)[:, None, None] + serial
    return ((base + steps) % 251).to(torch.uint8)


def episode(serial: int, length: int) -> Episode:
    return Episode(
        {"obs": frames_of(serial, length), "reward": torch.arange(length, dtype=torch.float32)}
    )


def make_buffer(
    frames: int, pad: str, *, capacity: int = 60, kind: type = SequenceReplay, **kwargs: object
) -> SequenceReplay:
    schema = {
        "obs": Field(FRAME, torch.uint8, stack=frames, stack_pad=pad),
        "reward": ((), torch.float32),
    }
    return kind(capacity, schema=schema, seed=3, **kwargs)


def expected_stacks(
    buffer: SequenceReplay,
    ids: torch.Tensor,
    steps: torch.Tensor,
    frames: int,
    pad: str,
) -> torch.Tensor:
    """The reference: each record's frames ``t - k + 1 .. t`` read from ``buffer[id]``."""
    out = torch.empty((*ids.shape, frames, *FRAME), dtype=torch.uint8)
    for index in itertools.product(*(range(n) for n in ids.shape)):
        episode_id, step = int(ids[index]), int(steps[index])
        stored = buffer[episode_id]["obs"]
        first = buffer.episode_info(episode_id).first_step if _segmented(buffer) else 0
        for j in range(frames):
            target = step - (frames - 1 - j)
            if target < first:
                out[index][j] = 0 if pad == "zeros" else stored[0]
            else:
                out[index][j] = stored[target - first]
    return out


def _segmented(buffer: SequenceReplay) -> bool:
    return buffer._core.store.segments is not None


def check_windows(buffer: SequenceReplay, batch, frames: int, pad: str) -> None:
    want = expected_stacks(buffer, batch.record_episode_ids, batch.record_steps, frames, pad)
    assert batch.data["obs"].shape == (*batch.record_steps.shape, frames, *FRAME)
    assert torch.equal(batch.data["obs"], want)


def fill(buffer: SequenceReplay, lengths: list[int]) -> None:
    for number, length in enumerate(lengths):
        buffer.add(episode(11 * number, length))


WINDOWS = [
    Window(4),
    Window(3, burn_in=3, bootstrap=1),
    Window(2, burn_in=2, bootstrap=2, dilation=2, boundary="stop", allow_partial=True),
    Window(5, burn_in=1, boundary="include_reset", allow_partial=True),
]


@pytest.mark.parametrize("pad", ["same", "zeros"])
@pytest.mark.parametrize("frames", [2, 4])
@pytest.mark.parametrize("segment_length", [None, 3])
def test_windows_equal_reference_on_every_engine(
    index_engine: str, pad: str, frames: int, segment_length: int | None
) -> None:
    """sample_windows (every boundary) and gather_windows from step 0: stacks of stored frames."""
    buffer = make_buffer(frames, pad, capacity=40, segment_length=segment_length)
    fill(buffer, [7, 2, 9, 5, 12, 8, 6])  # evicts the oldest (heads, when segmented)
    for window in WINDOWS:
        if segment_length is not None and window.boundary == "include_reset":
            continue
        check_windows(buffer, buffer.sample_windows(16, window), frames, pad)
    ids = torch.tensor(list(buffer.episode_ids)[:3])
    firsts = torch.tensor([buffer.episode_info(int(i)).first_step for i in ids])
    batch = buffer.gather_windows(ids, firsts, Window(3, burn_in=2))  # clamped before start
    check_windows(buffer, batch, frames, pad)


@pytest.mark.parametrize("pad", ["same", "zeros"])
def test_chunks_equal_reference(index_engine: str, pad: str) -> None:
    """sample(): chunks of consecutive steps, stacked, on whole and segmented buffers."""
    for segment_length in (None, 4):
        buffer = make_buffer(3, pad, segment_length=segment_length)
        fill(buffer, [7, 2, 9, 5, 12])
        batch = buffer.sample(20, 3)
        steps = batch.starts[:, None] + torch.arange(3)
        ids = batch.episode_ids[:, None].expand(-1, 3)
        assert torch.equal(batch.data["obs"], expected_stacks(buffer, ids, steps, 3, pad))


def test_engines_draw_equal_batches() -> None:
    """The compiled loops, numpy and torch engines give bit-identical stacked batches."""
    batches = []
    for name in engine.ENGINES:
        if name == "kernels" and not engine.available():
            continue
        with engine.use(name):
            buffer = make_buffer(4, "zeros", capacity=40, segment_length=5)
            fill(buffer, [7, 2, 9, 5, 12, 8, 6])
            batches.append(buffer.sample_windows(32, Window(4, burn_in=4)).data["obs"])
    assert all(torch.equal(batches[0], other) for other in batches[1:])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(1, 14), min_size=1, max_size=8),
    frames=st.integers(1, 6),
    pad=st.sampled_from(["same", "zeros"]),
    segment_length=st.sampled_from([None, 1, 2, 5]),
    window=st.builds(
        Window,
        st.integers(1, 4),
        burn_in=st.integers(0, 4),
        bootstrap=st.integers(0, 2),
        dilation=st.integers(1, 3),
        boundary=st.sampled_from(["pad", "stop"]),
        allow_partial=st.just(True),
    ),
    capacity=st.integers(14, 40),
)
def test_property_stacks_equal_reference(
    lengths: list[int],
    frames: int,
    pad: str,
    segment_length: int | None,
    window: Window,
    capacity: int,
) -> None:
    """Any episodes, window, stack and ring size: each record's stack is its stored frames."""
    buffer = make_buffer(frames, pad, capacity=capacity, segment_length=segment_length)
    fill(buffer, lengths)
    batch = buffer.sample_windows(8, window)
    if frames == 1:
        want = expected_stacks(buffer, batch.record_episode_ids, batch.record_steps, 1, pad)
        assert torch.equal(batch.data["obs"], want[:, :, 0])
    else:
        check_windows(buffer, batch, frames, pad)


def test_stored_one_frame_per_step_and_memory_report() -> None:
    """The ring holds one frame per step; memory_report counts stored steps and allocation."""
    buffer = make_buffer(4, "same", capacity=50)
    assert buffer.memory_report()["total"] == {
        "raw_bytes": 0,
        "stored_bytes": 0,
        "cache_bytes": 0,
    }
    fill(buffer, [7, 9])
    assert buffer[0]["obs"].shape == (7, *FRAME)
    assert tuple(buffer._core.store.ring.fields["obs"].shape) == (50, *FRAME)
    report = buffer.memory_report()
    assert report["fields"]["obs"] == {
        "raw_bytes": 16 * 6,
        "stored_bytes": 50 * 6,
        "cache_bytes": 0,
    }
    assert report["fields"]["reward"] == {
        "raw_bytes": 16 * 4,
        "stored_bytes": 200,
        "cache_bytes": 0,
    }
    assert report["total"] == {"raw_bytes": 160, "stored_bytes": 500, "cache_bytes": 0}


def test_out_batches_prioritized_iterate_and_tensordict() -> None:
    """out= reuse, sample_prioritized, iterate and to_tensordict carry [.., k, *shape] stacks."""
    buffer = make_buffer(3, "same", kind=PrioritizedSequenceReplay)
    fill(buffer, [7, 2, 9, 5])
    window = Window(3, burn_in=1)
    first = buffer.sample_windows(6, window)
    again = buffer.sample_windows(6, window, out=first)
    assert again is first
    check_windows(buffer, again, 3, "same")
    chunks = buffer.sample_prioritized(5, 2)
    assert chunks.data["obs"].shape == (5, 2, 3, *FRAME)
    chunks_again = buffer.sample_prioritized(5, 2, out=chunks)
    steps = chunks_again.starts[:, None] + torch.arange(2)
    ids = chunks_again.episode_ids[:, None].expand(-1, 2)
    assert torch.equal(chunks_again.data["obs"], expected_stacks(buffer, ids, steps, 3, "same"))
    with buffer.iterate(4, window, prefetch=1) as batches:
        check_windows(buffer, next(batches), 3, "same")
    pytest.importorskip("tensordict")
    assert tuple(first.to_tensordict()["obs"].shape) == (6, 4, 3, *FRAME)


def test_out_of_another_layout_is_refused() -> None:
    """An out= batch of unstacked frames cannot receive a stacked draw; nothing changes."""
    buffer = make_buffer(3, "same")
    fill(buffer, [7, 9])
    plain = SequenceReplay(60, seed=0)
    plain.add(episode(0, 9))
    wrong = plain.sample_windows(4, Window(2))
    assert_refused(
        buffer,
        lambda: buffer.sample_windows(4, Window(2), out=wrong),
        InvalidArgumentError,
        r"out\['obs'\] must be a contiguous torch.uint8 tensor of shape \(4, 2, 3, 3, 2\)",
    )


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"shape": [3]}, InvalidArgumentError, r"shape must be a tuple of ints >= 0, got \[3\]"),
        ({"shape": (True,)}, InvalidArgumentError, r"shape must be a tuple of ints >= 0"),
        ({"shape": (-1,)}, InvalidArgumentError, r"shape must be a tuple of ints >= 0"),
        ({"dtype": "uint8"}, InvalidTypeError, r"dtype must be a torch.dtype, got 'uint8'"),
        ({"stack": 0}, InvalidArgumentError, r"stack must be an int in \[1, 1024\], got 0"),
        ({"stack": True}, InvalidTypeError, r"stack must be an int, got True"),
        ({"stack": 2.0}, InvalidTypeError, r"stack must be an int, got 2.0"),
        ({"stack_pad": "reset"}, InvalidArgumentError, r"stack_pad must be one of"),
        ({"codec": "gzip"}, InvalidArgumentError, r"codec must be None or one of"),
    ],
)
def test_field_refuses_bad_values(kwargs: dict, error: type, match: str) -> None:
    """Field validates itself, naming the argument and the bad value."""
    arguments = {"shape": (2,), "dtype": torch.uint8, **kwargs}
    shape, dtype = arguments.pop("shape"), arguments.pop("dtype")
    with pytest.raises(error, match=match):
        Field(shape, dtype, **arguments)


def test_schema_compares_and_reports_fields() -> None:
    """buffer.schema keeps the Field; (shape, dtype) fields compare as before."""
    buffer = make_buffer(4, "zeros")
    schema = buffer.schema
    assert schema is not None
    assert schema["obs"] == (FRAME, torch.uint8)  # what one step stores
    assert schema == {
        "obs": Field(FRAME, torch.uint8, stack=4, stack_pad="zeros"),
        "reward": ((), torch.float32),
    }
    assert schema != {"obs": (FRAME, torch.uint8), "reward": ((), torch.float32)}
    assert Field((2,), torch.uint8) == Field((2,), torch.uint8, stack=1)
    plain = SequenceReplay(10, schema={"obs": Field((2,), torch.uint8)})
    assert plain.schema == {"obs": ((2,), torch.uint8)}


@pytest.mark.parametrize("segment_length", [None, 4])
def test_checkpoint_round_trip(tmp_path, segment_length: int | None) -> None:
    """save/load keeps the stacks (frames, pad) and the draws."""
    buffer = make_buffer(3, "zeros", segment_length=segment_length)
    fill(buffer, [7, 2, 9, 5])
    path = tmp_path / "stacked.pt"
    buffer.save(path)
    loaded = SequenceReplay.load(path)
    assert loaded.schema == buffer.schema
    window = Window(3, burn_in=2)
    assert torch.equal(
        loaded.sample_windows(8, window).data["obs"], buffer.sample_windows(8, window).data["obs"]
    )


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        ({"stack": 0, "stack_pad": "same", "codec": None}, "stack must be an int in"),
        ({"stack": True, "stack_pad": "same", "codec": None}, "stack must be an int"),
        ({"stack": 2, "stack_pad": "up", "codec": None}, "stack_pad must be one of"),
        ({"stack": 2, "stack_pad": "same", "codec": "gzip"}, "codec must be None or one of"),
        ({"stack": 2}, r"must be a dict of \['stack', 'stack_pad', 'codec'\]"),
        ("stack", r"must be a dict of"),
    ],
)
def test_checkpoint_with_bad_field_is_refused(entry: object, match: str) -> None:
    """A crafted Field entry in a checkpoint's schema is refused; the buffer is unchanged."""
    buffer = make_buffer(3, "same")
    fill(buffer, [7])
    state = buffer.state_dict()
    state.pop("checksum", None)
    state["schema"]["obs"][2] = entry
    state["config"]["schema"]["obs"][2] = entry
    target = make_buffer(3, "same")
    with pytest.raises(CheckpointError, match=match):
        target.load_state_dict(state)
    assert len(target) == 0


def test_checkpoint_stacks_must_match_declared() -> None:
    """Stored data under another stack than the declared schema's is refused."""
    buffer = make_buffer(3, "same")
    fill(buffer, [7])
    state = buffer.state_dict()
    state.pop("checksum", None)
    state["schema"]["obs"][2] = {"stack": 2, "stack_pad": "same", "codec": None}
    with pytest.raises(CheckpointError, match="must be the declared schema"):
        make_buffer(3, "same").load_state_dict(state)
