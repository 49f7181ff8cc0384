"""The fast path of `EpisodeStream.append`: what it caches between calls still refuses
changed steps, and steps off the fast path store what the full path stores."""

from __future__ import annotations

import torch
from conftest import comparable
from segmented_buffers import refused_changes_nothing

from lucid_replay import SequenceReplay


def _steps(count: int) -> dict[str, torch.Tensor]:
    return {"x": torch.arange(count), "y": torch.zeros(count, 2)}


def test_steps_changed_in_place_after_cached_appends_are_still_refused() -> None:
    buffer = SequenceReplay(capacity=20, segment_length=4)
    stream = buffer.open_episode()
    steps = _steps(4)
    for _ in range(3):  # the same dict and tensors: the cached comparison is what runs
        stream.append(steps)
    assert len(buffer) == 12

    retyped = _steps(4)
    stream.append(retyped)
    retyped["x"].data = torch.arange(4.0)  # the same tensor object, now float32
    refused_changes_nothing(buffer, stream, lambda: stream.append(retyped), TypeError, "x")

    reshaped = _steps(4)
    stream.append(reshaped)
    reshaped["y"].resize_(4, 3)  # the same tensor object, now [4, 3]
    refused_changes_nothing(buffer, stream, lambda: stream.append(reshaped), ValueError, "y")

    uneven = {"x": torch.arange(4), "y": torch.zeros(3, 2)}  # a count seen, then another
    refused_changes_nothing(
        buffer, stream, lambda: stream.append(uneven), ValueError, "one leading length"
    )
    scalar = {"x": torch.tensor(3), "y": torch.zeros(4, 2)}  # no step dimension
    refused_changes_nothing(buffer, stream, lambda: stream.append(scalar), ValueError, "x")
    extra = {**_steps(4), "z": torch.zeros(4)}
    refused_changes_nothing(buffer, stream, lambda: stream.append(extra), ValueError, "z")
    assert len(buffer) == 20 and stream.pending == 0


def test_steps_that_need_grad_or_another_count_still_store_what_the_full_path_stores() -> None:
    fast, full = (SequenceReplay(capacity=50, segment_length=4, seed=0) for _ in range(2))
    streams = fast.open_episode(), full.open_episode()
    for count in (4, 3, 5, 4, 1):  # counts beyond the first: their shapes are added
        steps = _steps(count)
        steps["y"] = torch.randn(count, 2, requires_grad=True)  # not the fast path
        streams[0].append(steps)
        streams[1].append({"x": steps["x"].tolist(), "y": steps["y"].detach().numpy()})
    assert comparable(fast.state_dict()) == comparable(full.state_dict())
