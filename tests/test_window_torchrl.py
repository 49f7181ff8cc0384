"""`gather_windows` against TorchRL's `Sequence` sample unit, anchor by anchor.

TorchRL 0.14.1 (`torchrl/data/replay_buffers/sample_units.py`, PR pytorch/rl#4051) expands an
anchor into `burn_in + length + bootstrap` records with `dilation` spacing and three boundary
policies. `gather_windows` gives the same records and masks for `allow_partial=True`, where
every stored step is an anchor. Both buffers receive the same episodes in the same order:

- `flat`: nothing is evicted, TorchRL's storage is not full; flat index = sum of the lengths of
  earlier episodes + step.
- `wrapped`: a prefix of episodes is written first and evicted; TorchRL's ring is full with its
  write seam inside the array, and `include_reset` must clamp at the oldest/newest stored step.

Records are compared through a per-step `serial` field (a global write counter), so neither
side's physical layout matters. TorchRL marks episode ends with `("next", "done")`, which is set
at the last step of every episode, terminated or truncated alike. Anchors are forced by calling
`Sequence.expand` directly with the physical storage index of every stored step.
"""

from __future__ import annotations

import functools
import itertools
import warnings

import pytest
import torch

with warnings.catch_warnings():
    # TorchRL may warn that its C++ extension failed to load; the Sequence unit is pure Python.
    warnings.simplefilter("ignore")
    pytest.importorskip("torchrl", minversion="0.14.1")
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, ReplayBuffer
    from torchrl.data.replay_buffers import Sequence

from lucid_replay import Episode, SequenceReplay, Window, engine

pytestmark = pytest.mark.usefixtures("index_engine")  # every engine of the index arithmetic

# (length, terminated): length-1 and length-2 episodes, terminated and truncated mixed.
EPISODES = [(5, True), (1, False), (2, True), (7, False), (1, True), (3, False), (2, False)]
# Written before EPISODES in the `wrapped` layout, then evicted by both buffers.
PREFIX = [(4, True), (3, False)]
FLAT_CAPACITY = 1_000

BOUNDARIES = ["pad", "stop", "include_reset"]
GRID = list(itertools.product([1, 3], [0, 2], [0, 1, 2], [1, 2]))
GRID_IDS = [f"len{n}-burn{b}-boot{s}-dil{d}" for n, b, s, d in GRID]


def _episode_arrays(length: int, first_serial: int) -> dict[str, torch.Tensor]:
    serial = torch.arange(first_serial, first_serial + length, dtype=torch.int64)
    obs = torch.stack([serial.float(), -serial.float()], dim=-1)
    return {"obs": obs, "serial": serial}


def _torchrl_episode(length: int, terminated: bool, first_serial: int) -> TensorDict:
    arrays = _episode_arrays(length, first_serial)
    last = torch.zeros(length, 1, dtype=torch.bool)
    last[-1] = True
    is_init = torch.zeros(length, 1, dtype=torch.bool)
    is_init[0] = True
    return TensorDict(
        {
            **arrays,
            "is_init": is_init,
            ("next", "done"): last,
            ("next", "terminated"): last & terminated,
            ("next", "truncated"): last & (not terminated),
        },
        batch_size=[length],
    )


@functools.cache
def _layout(name: str, index_engine: str):
    """Build both buffers for a layout; returns what the tests compare (cached per layout and
    index engine, which a buffer fixes when it is built).
    """
    written = (PREFIX if name == "wrapped" else []) + EPISODES
    stored_total = sum(length for length, _ in EPISODES)
    capacity = stored_total if name == "wrapped" else FLAT_CAPACITY

    ours = SequenceReplay(capacity=capacity)
    trl = ReplayBuffer(storage=LazyTensorStorage(capacity))
    first_serials = []
    serial = 0
    for length, terminated in written:
        first_serials.append(serial)
        ours.add(Episode(_episode_arrays(length, serial), terminated=terminated))
        trl.extend(_torchrl_episode(length, terminated, serial))
        serial += length

    stored_ids = list(range(len(written) - len(EPISODES), len(written)))
    assert list(ours.episode_ids) == stored_ids, "precondition: exactly EPISODES are stored"
    storage = trl.storage
    assert len(storage) == stored_total, "precondition: TorchRL holds exactly EPISODES"
    assert (len(storage) == storage.max_size) == (name == "wrapped"), "precondition: ring full"

    # Every stored step as an anchor, oldest first.
    episode_ids = torch.tensor(
        [eid for eid, (length, _) in zip(stored_ids, EPISODES, strict=True) for _ in range(length)]
    )
    anchor_steps = torch.cat([torch.arange(length) for length, _ in EPISODES])
    first_serial = torch.tensor(first_serials)
    anchor_serials = first_serial[episode_ids] + anchor_steps

    serial_at = storage.get("serial").reshape(-1)  # physical index -> serial
    physical_of_serial = {int(s): i for i, s in enumerate(serial_at.tolist())}
    anchors = torch.tensor([physical_of_serial[int(s)] for s in anchor_serials])
    return ours, storage, episode_ids, anchor_steps, first_serial, anchors


def _both(layout, boundary, length, burn_in, bootstrap, dilation):
    ours, storage, episode_ids, anchor_steps, first_serial, anchors = _layout(
        layout, engine.current()
    )
    window = Window(
        length,
        burn_in=burn_in,
        bootstrap=bootstrap,
        dilation=dilation,
        boundary=boundary,
        allow_partial=True,
    )
    batch = ours.gather_windows(episode_ids, anchor_steps, window)
    unit = Sequence(
        length,
        episode_boundary=boundary,
        burn_in=burn_in,
        bootstrap=bootstrap,
        dilation=dilation,
    )
    index, info = unit.expand(anchors.clone(), {}, storage)
    B, W = anchors.shape[0], window.size
    reference = {
        "index": index.reshape(B, W),
        "validity_mask": info["validity_mask"].reshape(B, W),
        "learning_mask": info["learning_mask"].reshape(B, W),
        "anchor_index": info["anchor_index"].reshape(B, W),
    }
    return batch, reference, storage, first_serial, episode_ids, anchor_steps


def _serial_of_records(batch, first_serial):
    return first_serial[batch.record_episode_ids.cpu()] + batch.record_steps.cpu()


@pytest.mark.parametrize("layout", ["flat", "wrapped"])
@pytest.mark.parametrize("boundary", BOUNDARIES)
@pytest.mark.parametrize(("length", "burn_in", "bootstrap", "dilation"), GRID, ids=GRID_IDS)
def test_records_and_masks_match_torchrl_sequence(
    layout, boundary, length, burn_in, bootstrap, dilation
):
    """Every anchor's record indices, validity_mask and learning_mask equal TorchRL Sequence's."""
    batch, ref, storage, first_serial, episode_ids, anchor_steps = _both(
        layout, boundary, length, burn_in, bootstrap, dilation
    )
    B, W = ref["index"].shape
    assert tuple(batch.record_episode_ids.shape) == (B, W)
    assert torch.equal(batch.episode_ids.cpu(), episode_ids)
    assert torch.equal(batch.anchor_steps.cpu(), anchor_steps)

    expected_serials = storage.get("serial").reshape(-1)[ref["index"]]
    ours_serials = _serial_of_records(batch, first_serial)
    mismatch = (ours_serials != expected_serials).any(-1).nonzero().flatten().tolist()
    assert not mismatch, (
        f"records differ at anchors {mismatch[:5]}: ours {ours_serials[mismatch[:5]].tolist()}, "
        f"torchrl {expected_serials[mismatch[:5]].tolist()}"
    )
    assert torch.equal(batch.validity_mask.cpu(), ref["validity_mask"])
    assert torch.equal(batch.learning_mask.cpu(), ref["learning_mask"])
    # TorchRL's anchor_index is the drawn (pre-shift) anchor; ours reports the drawn anchor too.
    anchor_serials = storage.get("serial").reshape(-1)[ref["anchor_index"][:, 0]]
    assert torch.equal(first_serial[episode_ids] + anchor_steps, anchor_serials)


@pytest.mark.parametrize("layout", ["flat", "wrapped"])
@pytest.mark.parametrize("boundary", BOUNDARIES)
@pytest.mark.parametrize(("length", "burn_in", "bootstrap", "dilation"), GRID, ids=GRID_IDS)
def test_data_terminal_is_init_follow_torchrl_records(
    layout, boundary, length, burn_in, bootstrap, dilation
):
    """Data and terminal equal TorchRL's (clamped) records; is_init is derived from them."""
    batch, ref, storage, _, _, _ = _both(layout, boundary, length, burn_in, bootstrap, dilation)
    index, valid = ref["index"], ref["validity_mask"]

    assert torch.equal(batch.data["obs"].cpu(), storage.get("obs")[index])
    assert torch.equal(batch.data["serial"].cpu(), storage.get("serial")[index])
    terminated = storage.get(("next", "terminated")).reshape(-1)
    assert torch.equal(batch.terminal.cpu(), terminated[index])

    # TorchRL's Sequence has no is_init; ours: the first valid record of each window, plus every
    # valid record that is step 0 of an episode (TorchRL's InitTracker flag, stored per step).
    episode_start = storage.get("is_init").reshape(-1)[index]
    first_valid = torch.zeros_like(valid)
    first_valid[torch.arange(valid.shape[0]), valid.int().argmax(-1)] = True
    expected = valid & (episode_start | first_valid)
    assert torch.equal(batch.is_init.cpu(), expected)
