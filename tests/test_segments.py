"""Streamed segments: streaming equals adding, windows across seams equal contiguous steps,
the law with open episodes and evicted heads, and segment-granular eviction."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import both_engines, comparable, make_episode
from segmented_buffers import refused_changes_nothing, stream_interleaved
from stats import ACCEPT, REJECT, chi_square_pvalue

from lucid_replay import Episode, PrioritizedSequenceReplay, SequenceReplay, Window


def stream_in_pieces(
    buffer: SequenceReplay, episode: Episode, rng: np.random.Generator, *, flush: bool = False
) -> int:
    """Stream ``episode`` in random pieces (1 .. 2L steps), optionally flushing at random."""
    stream = buffer.open_episode()
    length, begin = len(episode), 0
    assert buffer.segment_length is not None
    while begin < length:
        size = int(rng.integers(1, 2 * buffer.segment_length + 1))
        stream.append({name: t[begin : begin + size] for name, t in episode.steps.items()})
        begin += size
        if flush and rng.random() < 0.3:
            stream.flush()
    stream.close(terminated=episode.terminated)
    return stream.episode_id


CONFIGS = [
    pytest.param(SequenceReplay, {"unit": "chunk"}, id="uniform-chunk"),
    pytest.param(SequenceReplay, {"unit": "episode"}, id="uniform-episode"),
    pytest.param(SequenceReplay, {"max_times_sampled": 3}, id="reuse-limit"),
    pytest.param(PrioritizedSequenceReplay, {"unit": "chunk"}, id="prioritized-episode-unit"),
    pytest.param(PrioritizedSequenceReplay, {"unit": "episode"}, id="prioritized-unit-episode"),
    pytest.param(
        PrioritizedSequenceReplay, {"priority_unit": "segment"}, id="prioritized-segment-unit"
    ),
]


@pytest.mark.parametrize(("kind", "config"), CONFIGS)
@both_engines
def test_streaming_in_random_pieces_equals_add_ids_data_stats_and_draws(kind, config) -> None:
    rng = np.random.default_rng(7)
    twins = [kind(capacity=60, segment_length=4, seed=3, **config) for _ in range(2)]
    window = Window(3, burn_in=2, bootstrap=1)
    for round_ in range(12):
        episode = make_episode(int(rng.integers(1, 25)), terminated=bool(round_ % 2))
        ids = [twins[0].add(episode), stream_in_pieces(twins[1], episode, rng)]
        assert ids[0] == ids[1] == round_
        batches = []
        for buffer in twins:
            try:
                batch = buffer.sample_windows(5, window)
            except ValueError as error:  # both refuse alike (reuse limit, nothing eligible)
                batches.append(str(error))
                continue
            batches.append(comparable({"data": dict(batch.data), "ids": batch.episode_ids}))
            if isinstance(buffer, PrioritizedSequenceReplay):
                buffer.update_priorities_from(batch, torch.arange(5 * window.size).view(5, -1))
        assert batches[0] == batches[1]
        assert twins[0].stats() == twins[1].stats()
        assert comparable(twins[0].state_dict()) == comparable(twins[1].state_dict())
    assert twins[0].stats()["segments_evicted"] > 0  # heads were evicted along the way


def test_add_stores_ceil_t_over_l_segments_and_counts_them() -> None:
    buffer = SequenceReplay(capacity=100, segment_length=4)
    episode_id = buffer.add(make_episode(10, terminated=True))
    info = buffer.episode_info(episode_id)
    assert (info.num_segments, info.total_length, info.stored_length) == (3, 10, 10)
    assert (info.first_step, info.is_open, info.terminated) == (0, False, True)
    assert buffer.stats()["segments_stored"] == 3 and len(buffer) == 10
    assert bool(buffer[episode_id]["serial"].diff().eq(1).all())


def test_an_append_commits_every_l_steps_when_it_returns() -> None:
    buffer = SequenceReplay(capacity=100, segment_length=4)
    stream = buffer.open_episode()
    assert stream.episode_id == 0 and 0 not in buffer and buffer.open_episode_ids == [0]
    assert stream.append({"x": torch.arange(3)}) == [] and len(buffer) == 0
    assert stream.pending == 3
    assert stream.append({"x": torch.arange(3, 13)}) == [0, 1, 2] and len(buffer) == 12
    assert stream.pending == 1 and 0 in buffer
    assert buffer[0]["x"].tolist() == list(range(12))
    assert not buffer[0].terminated  # open: never terminated
    assert stream.flush() == 3 and stream.flush() is None and len(buffer) == 13
    stream.close(terminated=True)
    assert buffer.open_episode_ids == [] and buffer[0].terminated
    assert buffer.episode_info(0).num_segments == 4


def test_eviction_is_by_segment_oldest_first_and_an_episode_may_outlive_capacity() -> None:
    buffer = SequenceReplay(capacity=12, segment_length=4)
    stream = buffer.open_episode()
    for begin in range(0, 120, 5):  # 10x capacity through one stream
        stream.append({"x": torch.arange(begin, begin + 5)})
        info = buffer.episode_info(0)
        assert len(buffer) <= 12 and info.stored_length == len(buffer)
        assert buffer[0]["x"].tolist() == list(range(info.first_step, info.total_length))
    assert buffer.episode_info(0).first_step == 108 and buffer.episode_info(0).total_length == 120
    stats = buffer.stats()
    assert stats["transitions_evicted"] == 108 and stats["segments_evicted"] == 27
    assert stats["episodes_evicted"] == 0  # still stored: it lost its head only


def test_an_open_episode_whose_committed_steps_were_all_evicted_is_not_in_the_buffer() -> None:
    buffer = SequenceReplay(capacity=8, segment_length=4)
    old = buffer.open_episode()
    old.append({"x": torch.arange(4)})
    buffer.add(Episode({"x": torch.arange(8)}))
    assert 0 not in buffer and buffer.open_episode_ids == [0]
    assert buffer.episode_info(0).stored_length == 0 and buffer.episode_info(0).first_step == 4
    with pytest.raises(KeyError, match="open with no stored step"):
        buffer[0]
    old.close(terminated=False)  # leaves now, counted as evicted
    assert buffer.stats()["episodes_evicted"] == 1
    with pytest.raises(KeyError, match="was evicted"):
        buffer.episode_info(0)


# ------------------------------------------------------------------ windows across seams
def _interleaved_buffer(rng: np.random.Generator, capacity: int = 90) -> SequenceReplay:
    """Five episodes streamed at once in random pieces with flushes; heads evicted; two open."""
    buffer = SequenceReplay(capacity=capacity, segment_length=5)

    def obs(serial: torch.Tensor) -> torch.Tensor:
        return serial.float()[:, None].repeat(1, 2)

    options = {"streams": 5, "rounds": 60, "max_piece": 8, "serial_base": 1000}
    streams = stream_interleaved(buffer, rng, obs=obs, flush_chance=0.2, **options)
    for which in (0, 2, 3):
        streams[which].close(terminated=which != 2)
    return buffer


WINDOWS = [
    Window(3),
    Window(4, burn_in=3, bootstrap=2),
    Window(2, burn_in=2, bootstrap=1, dilation=3),
    Window(4, burn_in=2, bootstrap=2, boundary="stop"),
    Window(3, burn_in=1, bootstrap=1, dilation=2, boundary="stop"),
    Window(5, bootstrap=1, allow_partial=True),
]


@pytest.mark.parametrize("window", WINDOWS, ids=repr)
@both_engines
def test_windows_across_seams_equal_the_same_windows_on_the_steps_stored_contiguously(
    window: Window,
) -> None:
    buffer = _interleaved_buffer(np.random.default_rng(11))
    assert buffer.stats()["segments_evicted"] > 0
    infos = [buffer.episode_info(episode_id) for episode_id in buffer.episode_ids]
    assert max(info.num_segments for info in infos) >= 4  # seams to cross
    assert any(info.first_step > 0 for info in infos) and any(info.is_open for info in infos)
    for episode_id, info in zip(buffer.episode_ids, infos, strict=True):
        stored = buffer[episode_id]
        whole = SequenceReplay(capacity=1000)
        whole.add(Episode(stored.steps, terminated=info.terminated))
        steps = torch.arange(info.stored_length)
        mine = buffer.gather_windows([episode_id] * len(steps), steps + info.first_step, window)
        theirs = whole.gather_windows([0] * len(steps), steps, window)
        for name in ("serial", "obs"):
            assert torch.equal(mine[name], theirs[name])
        for name in ("validity_mask", "is_init", "terminal", "learning_mask"):
            assert torch.equal(getattr(mine, name), getattr(theirs, name)), name
        assert torch.equal(mine.record_steps, theirs.record_steps + info.first_step)
        assert torch.equal(mine.anchor_steps, theirs.anchor_steps + info.first_step)
        assert bool((mine.record_episode_ids == episode_id).all())


def test_include_reset_is_refused_on_a_segmented_buffer() -> None:
    buffer = SequenceReplay(capacity=20, segment_length=4)
    buffer.add(make_episode(6))
    window = Window(2, boundary="include_reset")
    for call in (
        lambda: buffer.sample_windows(2, window),
        lambda: buffer.gather_windows([0], [0], window),
        lambda: buffer.num_eligible(window),
        lambda: buffer.iterate(2, window),
    ):
        with pytest.raises(ValueError, match=r"window\.boundary must be"):
            call()


# ------------------------------------------------------------------------ eligibility
def test_open_episodes_need_the_bootstrap_records_committed_and_num_eligible_agrees() -> None:
    buffer = SequenceReplay(capacity=100, segment_length=4, seed=0)
    stream = buffer.open_episode()
    stream.append({"x": torch.arange(8)})  # steps 0..7 committed
    window = Window(3, burn_in=2, bootstrap=2)  # learning 3 + bootstrap 2 = 5 steps
    assert buffer.num_eligible(window) == 4  # anchors 0..3 (3 + 4 <= 7)
    assert buffer.num_eligible(Window(3)) == 6  # a chunk needs its own steps only
    assert buffer.num_eligible(Window(3, bootstrap=2, allow_partial=True)) == 4
    batch = buffer.sample_windows(500, window)
    assert set(batch.anchor_steps.tolist()) == {0, 1, 2, 3}
    assert not bool(batch.terminal.any())
    stream.close(terminated=True)  # closed: section 4's rule (learning region inside)
    assert buffer.num_eligible(window) == 6
    assert buffer.num_eligible(Window(3, bootstrap=2, allow_partial=True)) == 8
    batch = buffer.sample_windows(500, window)
    assert set(batch.anchor_steps.tolist()) == set(range(6))


def test_a_draw_waits_for_an_open_episodes_bootstrap_instead_of_padding_a_false_end() -> None:
    buffer = SequenceReplay(capacity=100, segment_length=4)
    stream = buffer.open_episode()
    stream.append({"x": torch.arange(4)})
    with pytest.raises(ValueError, match="committed steps"):
        buffer.sample_windows(1, Window(3, bootstrap=2))
    stream.append({"x": torch.arange(4, 8)})
    assert buffer.sample_windows(1, Window(3, bootstrap=2)).validity_mask.all()


def _expected_law(buffer, window: Window, alpha: float, by_segment: bool) -> dict:
    """P(episode, step) by enumeration: eligible anchors of each stored episode, weighted by
    the priority of the episode or of the segment holding the step."""
    law = {}
    state = buffer.state_dict()
    priorities = {}
    columns = state["table"]["columns"]
    for episode_id in buffer.episode_ids:
        info = buffer.episode_info(episode_id)
        need = window.open_anchor_span if info.is_open else window.anchor_span
        for step in range(info.first_step, info.total_length - need + 1):
            law[(episode_id, step)] = None
    if by_segment:
        key = columns["episode_id"]
        stored = (key >= state["table"]["first_id"]) & (key < state["table"]["next_id"])
        episodes = state["table"]["episodes"]["columns"]["episode_id"]
        for row in stored.nonzero().flatten().tolist():
            episode_id = int(episodes[int(columns["slot"][row])])
            first = int(columns["first_step"][row])
            for step in range(first, first + int(columns["length"][row])):
                priorities[(episode_id, step)] = float(columns["priority"][row])
    else:
        by_id = dict(zip(buffer.episode_ids, buffer.priorities.tolist(), strict=True))
        priorities = {anchor: by_id[anchor[0]] for anchor in law}
    return {anchor: priorities[anchor] ** alpha for anchor in law}


@pytest.mark.parametrize("priority_unit", ["episode", "segment"])
@both_engines
def test_the_law_with_open_episodes_evicted_heads_and_both_priority_units(priority_unit) -> None:
    buffer = PrioritizedSequenceReplay(
        capacity=40, alpha=0.7, segment_length=4, seed=5, priority_unit=priority_unit
    )
    rng = np.random.default_rng(2)
    open_stream = buffer.open_episode()
    open_stream.append({"x": torch.arange(10)})
    for length in (7, 9):
        buffer.add(Episode({"x": torch.arange(length)}))
    open_stream.append({"x": torch.arange(10, 33)})  # evicts heads: its own and others'
    window = Window(2, burn_in=1, bootstrap=2)
    # Distinct priorities through the public route.
    if priority_unit == "segment":
        ids = torch.arange(buffer.stats()["segments_added"])
    else:
        ids = torch.tensor(list(buffer.episode_ids))
    buffer.update_priorities(ids, rng.uniform(0.1, 5.0, ids.numel()))
    assert buffer.episode_info(0).first_step > 0 and buffer.open_episode_ids == [0]
    law = _expected_law(buffer, window, 0.7, priority_unit == "segment")
    batch = buffer.sample_windows(20_000, window)
    drawn = list(zip(batch.episode_ids.tolist(), batch.anchor_steps.tolist(), strict=True))
    cells = sorted(law)
    index = {cell: i for i, cell in enumerate(cells)}
    counts = np.bincount([index[cell] for cell in drawn], minlength=len(cells))
    probabilities = np.array([law[cell] for cell in cells])
    assert chi_square_pvalue(counts, probabilities) > ACCEPT
    flat = np.ones(len(cells))  # power: a law ignoring priorities is rejected
    assert chi_square_pvalue(counts, flat) < REJECT


def test_unit_episode_draws_stored_episodes_uniformly_whatever_their_segments() -> None:
    buffer = SequenceReplay(capacity=200, segment_length=3, unit="episode", seed=4)
    for length in (2, 5, 13, 31):  # 1, 2, 5 and 11 segments
        buffer.add(Episode({"x": torch.arange(length)}))
    stream = buffer.open_episode()
    stream.append({"x": torch.arange(20)})
    window = Window(2, bootstrap=1)
    batch = buffer.sample_windows(20_000, window)
    counts = np.bincount(batch.episode_ids.numpy(), minlength=5)
    assert chi_square_pvalue(counts, [1, 1, 1, 1, 1]) > ACCEPT
    assert chi_square_pvalue(counts, [1, 4, 12, 30, 18]) < REJECT
    inside = batch.anchor_steps[batch.episode_ids == 3].numpy()  # uniform over its 30 anchors
    assert chi_square_pvalue(np.bincount(inside, minlength=30), np.ones(30)) > ACCEPT


@pytest.mark.parametrize(("kind", "config"), CONFIGS)
@both_engines
def test_trees_kept_current_through_appends_closes_evictions_and_updates(kind, config) -> None:
    """After every call, a buffer rebuilt from its state (fresh trees) draws what it draws."""
    rng = np.random.default_rng(5)
    buffer = kind(capacity=50, segment_length=4, seed=9, **config)
    windows = [Window(3, burn_in=1, bootstrap=2), Window(2), Window(4, dilation=2)]
    streams = []
    for _ in range(60):
        action = rng.random()
        if action < 0.2 or not streams:
            streams.append(buffer.open_episode())
        elif action < 0.3:
            streams.pop(int(rng.integers(len(streams)))).close(terminated=bool(rng.random() < 0.5))
        elif action < 0.4:
            buffer.add(Episode({"x": torch.arange(int(rng.integers(1, 12)))}))
        else:
            stream = streams[int(rng.integers(len(streams)))]
            stream.append({"x": torch.arange(int(rng.integers(1, 9)))})
        for window in windows:
            if buffer.num_eligible(window) == 0:
                continue
            twin = kind(capacity=50, segment_length=4, **config)
            twin.load_state_dict(buffer.state_dict())
            try:
                mine = buffer.sample_windows(3, window)
            except ValueError:  # the reuse limit ran out: the twin must refuse alike
                with pytest.raises(ValueError):
                    twin.sample_windows(3, window)
                continue
            theirs = twin.sample_windows(3, window)
            assert torch.equal(mine.episode_ids, theirs.episode_ids)
            assert torch.equal(mine.anchor_steps, theirs.anchor_steps)
            if isinstance(buffer, PrioritizedSequenceReplay):
                assert torch.equal(mine.weights, theirs.weights)
                buffer.update_priorities_from(mine, torch.rand(3) * 4)


# -------------------------------------------------------------------- priorities by segment
def test_segment_priorities_ids_batches_and_routing() -> None:
    buffer = PrioritizedSequenceReplay(
        capacity=24, segment_length=4, seed=1, priority_unit="segment", alpha=1.0
    )
    first, second = buffer.open_episode(), buffer.open_episode()
    assert first.append({"x": torch.arange(8)}) == [0, 1]
    assert second.append({"x": torch.arange(5)}) == [2]
    assert first.append({"x": torch.arange(8, 12)}) == [3]  # ids in commit order
    buffer.update_priorities([1, 3], [5.0, 2.0])
    assert buffer.max_priority == pytest.approx(5.0 + buffer.epsilon)
    assert second.append({"x": torch.arange(5, 8)}) == [4]  # a new segment: the maximum
    assert buffer.priorities[4] == pytest.approx(5.0 + buffer.epsilon)
    batch = buffer.sample_prioritized(64, 2)
    assert batch.priority_unit == "segment" and torch.equal(batch.indices, batch.segment_ids)
    assert not torch.equal(batch.indices, batch.episode_ids)
    window = Window(2, burn_in=1, bootstrap=1)
    batch = buffer.sample_windows(32, window)
    before = buffer.priorities.clone()
    errors = torch.zeros(32, window.size)
    errors[:, 1] = 7.0  # the learning region's first record
    assert buffer.update_priorities_from(batch, errors, eta=1.0) == len(
        set(batch.segment_ids.tolist())
    )
    touched = sorted(set(batch.segment_ids.tolist()))
    after = buffer.priorities
    for segment in range(5):
        expected = 7.0 + buffer.epsilon if segment in touched else float(before[segment])
        assert float(after[segment]) == pytest.approx(expected)
    buffer.add(Episode({"x": torch.arange(20)}))  # evicts segments 0 .. 4
    assert buffer.update_priorities([0, 1, 6], [1.0, 1.0, 1.0]) == 1  # stale ids skipped
    with pytest.raises(ValueError, match="an issued segment id"):
        buffer.update_priorities([10], [1.0])


def test_episode_priorities_are_shared_by_an_episodes_segments_and_a_new_one_gets_the_max() -> None:
    buffer = PrioritizedSequenceReplay(capacity=100, segment_length=3, seed=0)
    stream = buffer.open_episode()
    stream.append({"x": torch.arange(7)})
    buffer.update_priorities([0], [3.0])
    stream.append({"x": torch.arange(7, 12)})  # its later segments share its priority
    state = buffer.state_dict()["table"]["columns"]
    stored = state["episode_id"][:4]
    assert stored.tolist() == [0, 1, 2, 3]
    assert torch.allclose(
        state["priority"][:4], torch.full((4,), 3.0 + buffer.epsilon, dtype=torch.float64)
    )
    other = buffer.open_episode()
    other.append({"x": torch.arange(3)})  # a new episode: the largest priority ever set
    assert buffer.priorities.tolist() == pytest.approx([3.0 + buffer.epsilon] * 2)
    batch = buffer.sample_prioritized(8, 2)
    assert torch.equal(batch.indices, batch.episode_ids)


# ------------------------------------------------------------------------- refusals
def test_constructor_refusals() -> None:
    with pytest.raises(ValueError, match="segment_length must be"):
        SequenceReplay(capacity=10, segment_length=11)
    with pytest.raises(ValueError, match="segment_length must be"):
        SequenceReplay(capacity=10, segment_length=0)
    with pytest.raises(TypeError, match="segment_length"):
        SequenceReplay(capacity=10, segment_length=True)
    with pytest.raises(ValueError, match="priority_unit must be"):
        PrioritizedSequenceReplay(capacity=10, priority_unit="segment")
    with pytest.raises(ValueError, match="priority_unit must be"):
        PrioritizedSequenceReplay(
            capacity=10, segment_length=2, unit="episode", priority_unit="segment"
        )
    with pytest.raises(ValueError, match="priority_unit must be one of"):
        PrioritizedSequenceReplay(capacity=10, segment_length=2, priority_unit="step")


def test_streaming_on_a_whole_episode_buffer_says_to_set_segment_length() -> None:
    buffer = SequenceReplay(capacity=10)
    with pytest.raises(ValueError, match="segment_length must be set"):
        buffer.open_episode()
    with pytest.raises(ValueError, match="segment_length must be set"):
        buffer.resume_episode(0)
    assert buffer.open_episode_ids == [] and buffer.segment_length is None


def test_refused_appends_and_closes_change_nothing() -> None:
    buffer = SequenceReplay(capacity=10, segment_length=4)
    stream = buffer.open_episode()
    stream.append({"x": torch.arange(6), "y": torch.zeros(6, 2)})
    cases = [
        (lambda: stream.append({"x": torch.arange(3)}), ValueError, "y"),
        (lambda: stream.append({"x": torch.arange(3.0), "y": torch.zeros(3, 2)}), TypeError, "x"),
        (lambda: stream.append({"x": torch.arange(3), "y": torch.zeros(3, 3)}), ValueError, "y"),
        (
            lambda: stream.append({"x": torch.arange(11), "y": torch.zeros(11, 2)}),
            ValueError,
            "at most capacity",
        ),
        (
            lambda: stream.append({"x": torch.arange(0), "y": torch.zeros(0, 2)}),
            ValueError,
            "must be >= 1",
        ),
        (lambda: stream.append([1, 2]), TypeError, "steps must be a mapping"),
        (lambda: stream.close(terminated=1), TypeError, "terminated must be a bool"),
    ]
    for call, error, match in cases:
        refused_changes_nothing(buffer, stream, call, error, match)
    stream.close(terminated=False)
    for call in (
        lambda: stream.append({"x": torch.arange(2), "y": torch.zeros(2, 2)}),
        lambda: stream.flush(),
        lambda: stream.close(terminated=True),
    ):
        refused_changes_nothing(buffer, stream, call, ValueError, "closed")
    with pytest.raises(ValueError, match="an open episode"):
        buffer.resume_episode(stream.episode_id)
    with pytest.raises(KeyError, match="never issued"):
        buffer.resume_episode(7)
    with pytest.raises(KeyError, match="never issued"):
        buffer.episode_info(7)
    assert True not in buffer


def test_add_of_an_episode_longer_than_capacity_stays_refused() -> None:
    buffer = SequenceReplay(capacity=10, segment_length=4)
    with pytest.raises(ValueError, match="capacity"):
        buffer.add(make_episode(11))
    assert buffer.stats()["episodes_added"] == 0 and buffer.open_episode_ids == []


def test_a_resumed_episode_supersedes_its_earlier_stream() -> None:
    buffer = SequenceReplay(capacity=20, segment_length=4)
    old = buffer.open_episode()
    old.append({"x": torch.arange(3)})
    new = buffer.resume_episode(old.episode_id)
    refused_changes_nothing(
        buffer, old, lambda: old.append({"x": torch.arange(1)}), ValueError, "superseded"
    )
    new.append({"x": torch.arange(4)})
    assert buffer[old.episode_id]["x"].tolist() == [0, 1, 2, 3]  # the old stream's 3 were its own


# ------------------------------------------------------------------------ checkpoints
@pytest.mark.parametrize("kind", [SequenceReplay, PrioritizedSequenceReplay])
def test_a_checkpoint_keeps_open_episodes_and_a_resumed_stream_continues_exactly(
    kind, tmp_path
) -> None:
    rng = np.random.default_rng(3)

    def run(buffer, streams, rounds):
        for _ in range(rounds):
            which = int(rng.integers(len(streams)))
            streams[which].append({"x": torch.arange(int(rng.integers(1, 7)))})
            if isinstance(buffer, PrioritizedSequenceReplay) and buffer.num_eligible(Window(2)):
                batch = buffer.sample_prioritized(4, 2)
                buffer.update_priorities(batch.indices, torch.from_numpy(rng.random(4)))

    buffer = kind(capacity=30, segment_length=4, seed=2)
    streams = [buffer.open_episode() for _ in range(3)]
    run(buffer, streams, 20)
    for stream in streams:
        stream.flush()  # pending steps are the caller's
    streams[1].close(terminated=True)
    path = tmp_path / "open.lucid"
    buffer.save(path)
    loaded = kind.load(path)
    assert loaded.open_episode_ids == buffer.open_episode_ids == [0, 2]
    for episode_id in buffer.episode_ids:
        assert loaded.episode_info(episode_id) == buffer.episode_info(episode_id)
    rng_state = rng.bit_generator.state
    mine = [buffer.resume_episode(i) for i in (0, 2)]
    theirs = [loaded.resume_episode(i) for i in (0, 2)]
    run(buffer, mine, 15)
    rng.bit_generator.state = rng_state
    run(loaded, theirs, 15)
    assert comparable(loaded.state_dict()) == comparable(buffer.state_dict())
    assert torch.equal(loaded.sample(5, 2)["x"], buffer.sample(5, 2)["x"])


def _tampered(state: dict, path: tuple, value) -> dict:
    import copy

    state = copy.deepcopy(state)
    target = state
    for key in path[:-1]:
        target = target[key]
    if callable(value):
        target[path[-1]] = value(target[path[-1]])
    else:
        target[path[-1]] = value
    return state


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("table", "episodes", "next_episode_id"), 1),
        (("table", "episodes", "columns", "total"), lambda t: t + 1),
        (("table", "episodes", "columns", "first_stored"), lambda t: t - 1),
        (("table", "episodes", "columns", "num_segments"), lambda t: t + 1),
        (("table", "episodes", "columns", "opened"), lambda t: torch.ones_like(t)),
        (("table", "episodes", "columns", "episode_id"), lambda t: t.flip(0)),
        (("table", "episodes", "columns", "priority"), lambda t: -t),
        (("table", "columns", "slot"), lambda t: torch.where(t >= 0, t.flip(0).clamp_min(0), t)),
        (("table", "columns", "first_step"), lambda t: t + 1),
        (("table", "columns", "next_key"), lambda t: torch.full_like(t, -1)),
        (("table", "columns", "prev_key"), lambda t: t + 1),
        (("table", "columns", "base"), lambda t: t + 1),
        (("table", "columns", "slot"), lambda t: t.to(torch.int32)),
        (("table", "episodes"), None),
        (("table", "episodes", "columns"), {}),
    ],
)
def test_crafted_segment_checkpoints_are_refused_and_change_nothing(path, value) -> None:
    from lucid_replay import CheckpointError

    buffer = SequenceReplay(capacity=30, segment_length=4, seed=0)
    streams = [buffer.open_episode() for _ in range(2)]
    for piece in range(6):
        streams[piece % 2].append({"x": torch.arange(5)})
    streams[1].close(terminated=True)
    state = buffer.state_dict()
    if path == ("table", "episodes") and value is None:
        state = _tampered(
            state, ("table",), lambda t: {k: v for k, v in t.items() if k != "episodes"}
        )
    else:
        state = _tampered(state, path, value)
    target = SequenceReplay(capacity=30, segment_length=4, seed=0)
    target.add(Episode({"x": torch.arange(3)}))
    before = comparable(target.state_dict())
    with pytest.raises(CheckpointError):
        target.load_state_dict(state)
    assert comparable(target.state_dict()) == before


def test_a_whole_episode_checkpoint_is_refused_by_a_segmented_buffer() -> None:
    from lucid_replay import CheckpointError

    whole = SequenceReplay(capacity=30)
    whole.add(Episode({"x": torch.arange(3)}))
    with pytest.raises(CheckpointError):
        SequenceReplay(capacity=30, segment_length=4).load_state_dict(whole.state_dict())


# ------------------------------------------------------------------ long runs and threads
def test_one_stream_of_ten_times_capacity_flows_through_while_others_open_and_close() -> None:
    rng = np.random.default_rng(8)
    buffer = PrioritizedSequenceReplay(capacity=64, segment_length=8, seed=3)
    endless, others, closed = buffer.open_episode(), [], 0
    window = Window(3, burn_in=2, bootstrap=2)
    appended = 0
    while appended < 640:
        size = int(rng.integers(1, 20))
        endless.append({"x": torch.arange(appended, appended + size)})
        appended += size
        if rng.random() < 0.3:
            others.append(buffer.open_episode())
        for stream in list(others):
            stream.append({"x": torch.arange(int(rng.integers(1, 6)))})
            if rng.random() < 0.2:
                stream.close(terminated=bool(rng.random() < 0.5))
                others.remove(stream)
                closed += 1
        info = buffer.episode_info(endless.episode_id)
        assert len(buffer) <= 64
        assert info.total_length == appended - endless.pending
        if info.stored_length:
            stored = buffer[endless.episode_id]["x"]
            assert stored.tolist() == list(range(info.first_step, info.total_length))
        if buffer.num_eligible(window):
            batch = buffer.sample_windows(8, window)
            assert bool((batch.record_episode_ids == batch.episode_ids[:, None]).all())
            buffer.update_priorities_from(batch, torch.rand(8, window.size))
        # Metadata stays bounded: table rows and directory slots follow what is stored.
        table = buffer._core.store.table
        assert table.row_count <= 1024 and table.directory.slot_count <= 64
    stats = buffer.stats()
    assert closed > 10 and stats["episodes_evicted"] > 10
    assert stats["transitions_added"] - stats["transitions_evicted"] == len(buffer)
    assert buffer.episode_info(endless.episode_id).first_step > 500


def test_streams_in_threads_while_readers_sample_never_show_part_of_a_segment() -> None:
    import threading

    buffer = SequenceReplay(capacity=2_000, segment_length=16, seed=0)
    failures: list[BaseException] = []
    done = threading.Event()

    def writer(index: int) -> None:
        try:
            rng = np.random.default_rng(index)
            for _ in range(3):
                stream, step = buffer.open_episode(), 0
                for _ in range(40):
                    size = int(rng.integers(1, 30))
                    values = torch.arange(step, step + size) + 1_000_000 * stream.episode_id
                    stream.append({"x": values, "y": values * 2})
                    step += size
                stream.close(terminated=True)
        except BaseException as error:  # reported by the main thread
            failures.append(error)

    def reader() -> None:
        try:
            while not done.is_set():
                if buffer.num_eligible(Window(4)) == 0:
                    continue
                batch = buffer.sample(32, 4)
                x, y = batch["x"], batch["y"]
                assert torch.equal(y, 2 * x)  # a record is written whole
                assert bool((x.diff(dim=1) == 1).all())  # consecutive committed steps
                expected = batch.episode_ids[:, None] * 1_000_000 + batch.starts[:, None]
                assert torch.equal(x[:, :1], expected)
        except BaseException as error:
            failures.append(error)

    writers = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    readers = [threading.Thread(target=reader) for _ in range(2)]
    for thread in writers + readers:
        thread.start()
    for thread in writers:
        thread.join()
    done.set()
    for thread in readers:
        thread.join()
    assert not failures, failures[0]
    assert buffer.stats()["episodes_added"] == 12 and buffer.open_episode_ids == []


def test_a_retired_open_episode_is_never_drawn_again_and_its_segments_age_out() -> None:
    buffer = SequenceReplay(capacity=24, segment_length=4, max_times_sampled=2, seed=0)
    old = buffer.open_episode()
    old.append({"x": torch.arange(8)})
    buffer.sample(2, 2)  # both draws from the only episode: retired, and reclaimed as oldest
    info = buffer.episode_info(old.episode_id)
    assert buffer.stats()["episodes_retired"] == 1 and len(buffer) == 0
    assert info.is_open and (info.first_step, info.total_length) == (8, 8)
    old.append({"x": torch.arange(8, 16)})  # committed, but the episode is retired
    assert len(buffer) == 8 and buffer.num_eligible(Window(2)) == 0
    other = buffer.add(Episode({"x": torch.arange(12)}))
    assert set(buffer.sample(2, 2).episode_ids.tolist()) == {other}
    assert old.episode_id not in buffer  # its retired segments went once oldest
    assert buffer.episode_info(old.episode_id).first_step == 16


def test_pending_steps_survive_pickling_and_keep_filling_their_own_memory() -> None:
    import pickle

    from lucid_replay.streams import PendingSteps

    stream = PendingSteps(episode_id=3, segment_length=6)
    stream._stash({"x": torch.arange(10, 14)}, 0, 2)
    copy = pickle.loads(pickle.dumps(stream))  # as a Ray task receives a sharded stream
    copy._stash({"x": torch.arange(20, 23)}, 0, 3)
    taken = copy._taken()
    assert taken is not None and taken[0]["x"].tolist() == [10, 11, 20, 21, 22]
    assert taken[1] is not None and taken[1]["x"].tolist() == [10, 11, 20, 21, 22]
    assert (copy.episode_id, copy.pending, repr(copy)) == (
        3,
        5,
        "PendingSteps(episode_id=3, pending=5)",
    )


def test_the_episode_directory_index_holds_through_growth_drops_and_compactions() -> None:
    from lucid_replay.directory import EpisodeDirectory

    directory = EpisodeDirectory(torch.device("cpu"))
    rng = np.random.default_rng(0)
    live: dict[int, int] = {}
    most = 0
    for _ in range(1_500):
        if live and rng.random() < 0.45:
            episode_id = int(rng.choice(list(live)))
            directory.drop(np.array([live.pop(episode_id)]))
        else:
            episode_id, slot = directory.open()
            live[episode_id] = slot
            most = max(most, len(live))
    assert len(set(live.values())) == len(live)  # no slot given twice
    asked = np.arange(directory.next_episode_id)
    expected = [live.get(int(i), -1) for i in asked]
    assert directory.slots_of(asked).tolist() == expected
    assert [directory.slot_of(int(i)) for i in asked] == expected
    assert directory.slot_count <= 2 * max(64, most)  # slots are reused
