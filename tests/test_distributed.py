"""`ShardedReplay` on backend="local": the exact cross-shard law, weights, ids and routing.

The statistical tests draw 100k anchors from four uneven shards (one empty, one holding
only episodes too short for the span, one at 10x the priority) and compare the
(episode, start) frequencies with the single buffer's formula over the union by chi-square
(accepted at p > ACCEPT). Each also shows its power: the same counts are rejected (p < REJECT)
against the law of a replay that picks a shard per batch (Reverb, RLlib Ape-X).
"""

from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest
import scipy.stats
import torch
from conftest import make_episode, snapshot

from lucid_replay import (
    EpisodeWriter,
    InvalidArgumentError,
    PrioritizedSequenceReplay,
    ReuseLimitError,
    Window,
)
from lucid_replay.distributed import ShardedReplay, ids, transport
from lucid_replay.distributed.calls import LocalHandle, get
from lucid_replay.distributed.shards import ReplayShard

ACCEPT = 1e-3
REJECT = 1e-6
ALPHA, BETA, EPSILON = 0.7, 0.5, 1e-6
WINDOW = Window(3, burn_in=2, bootstrap=1)  # anchor span 3


# ------------------------------------------------------------------------------ helpers
def _local(num_shards: int = 4, **kwargs: object) -> ShardedReplay:
    options = {"alpha": ALPHA, "beta": BETA, "epsilon": EPSILON, "seed": 7, **kwargs}
    return ShardedReplay.create(num_shards, 4000, backend="local", **options)


def _add_to(replay: ShardedReplay, shard: int, *lengths: int) -> list[int]:
    """Store episodes on one chosen shard (the client routes round robin)."""
    packed = [transport.pack_episode(make_episode(n)) for n in lengths]
    return [int(i) for i in get(replay._shards[shard].add.remote(packed))]


def _buffer(replay: ShardedReplay, shard: int) -> PrioritizedSequenceReplay:
    return replay._shards[shard].target.buffer


def _uneven(unit: str) -> tuple[ShardedReplay, dict[int, int], dict[int, float]]:
    """Shard 0 empty, shard 1 only 2-step episodes, shard 2 at 10x priority, shard 3 plain."""
    replay = _local(unit=unit)
    lengths: dict[int, int] = {}
    for shard, episode_lengths in ((1, (2, 2, 1)), (2, (4, 7, 3)), (3, (5, 9, 6, 3, 12))):
        stored = _add_to(replay, shard, *episode_lengths)
        for episode_id, n in zip(stored, episode_lengths, strict=True):
            lengths[episode_id] = n
    errors = {i: (10.0 if i >> 55 == 2 else 1.0) * (1 + (i % 3)) for i in lengths}
    replay.update_priorities(list(errors), list(errors.values()))
    return replay, lengths, errors


def _law(lengths, errors, span: int, unit: str, *, per_shard_batches: bool = False):
    """P(episode, start) of the single buffer over all shards (or of a per-batch shard pick)."""
    cells, probabilities = [], []
    shard_mass: dict[int, float] = {}
    for episode_id, n in lengths.items():
        anchors = max(n - span + 1, 0)
        mass = (anchors if unit == "chunk" else anchors > 0) * (
            abs(errors[episode_id]) + EPSILON
        ) ** ALPHA
        for start in range(anchors):
            cells.append((episode_id, start))
            probabilities.append(mass / anchors)
        shard_mass[episode_id >> 55] = shard_mass.get(episode_id >> 55, 0.0) + mass
    probabilities = np.asarray(probabilities)
    if per_shard_batches:  # a shard with mass uniformly, then its own law inside it
        live = [k for k, m in shard_mass.items() if m > 0]
        of = np.array([cell[0] >> 55 for cell in cells])
        probabilities = probabilities / np.array([shard_mass[k] for k in of]) / len(live)
    return cells, probabilities / probabilities.sum()


def _frequencies(replay, cells, draws: int, *, chunks: bool, batch: int = 2_000):
    index = {cell: at for at, cell in enumerate(cells)}
    counts = np.zeros(len(cells))
    for _ in range(draws // batch):
        if chunks:
            drawn = replay.sample_prioritized(batch, WINDOW.anchor_span)
            starts = drawn.starts
        else:
            drawn = replay.sample_windows(batch, WINDOW)
            starts = drawn.anchor_steps
        pairs = zip(drawn.episode_ids.tolist(), starts.tolist(), strict=True)
        np.add.at(counts, [index[pair] for pair in pairs], 1)
    return counts


# --------------------------------------------------------------------------- the law
@pytest.mark.statistical
@pytest.mark.parametrize("chunks", [False, True], ids=["windows", "chunks"])
@pytest.mark.parametrize("unit", ["chunk", "episode"])
def test_cross_shard_draws_follow_the_single_buffer_law_on_uneven_shards(unit, chunks):
    """(episode, start) frequencies over 100k draws match P over the union of the shards,
    and reject the law of a shard picked per batch."""
    replay, lengths, errors = _uneven(unit)
    cells, law = _law(lengths, errors, WINDOW.anchor_span, unit)
    counts = _frequencies(replay, cells, 100_000, chunks=chunks)
    assert counts.sum() == 100_000  # nothing ineligible was drawn (every draw has a cell)
    assert scipy.stats.chisquare(counts, counts.sum() * law).pvalue > ACCEPT
    _, wrong = _law(lengths, errors, WINDOW.anchor_span, unit, per_shard_batches=True)
    assert 0.5 * np.abs(law - wrong).sum() > 0.05  # the peers' law differs by this much
    assert scipy.stats.chisquare(counts, counts.sum() * wrong).pvalue < REJECT


@pytest.mark.statistical
def test_uniform_cross_shard_draws_weigh_every_eligible_anchor_alike():
    """``prioritized=False`` draws every eligible anchor of every shard equally often."""
    replay, lengths, _ = _uneven("chunk")
    ones = dict.fromkeys(lengths, 1.0)
    cells, law = _law(lengths, ones, WINDOW.anchor_span, "chunk")
    index = {cell: at for at, cell in enumerate(cells)}
    counts = np.zeros(len(cells))
    for _ in range(25):
        batch = replay.sample_windows(2_000, WINDOW, prioritized=False)
        assert batch.weights is None
        pairs = zip(batch.episode_ids.tolist(), batch.anchor_steps.tolist(), strict=True)
        np.add.at(counts, [index[pair] for pair in pairs], 1)
    assert scipy.stats.chisquare(counts, counts.sum() * law).pvalue > ACCEPT


@pytest.mark.parametrize("unit", ["chunk", "episode"])
def test_weights_are_the_formula_over_the_merged_batch_with_the_global_n(unit):
    """w = (N P)^-beta / max over the whole batch, N and P counted over every shard."""
    replay, lengths, errors = _uneven(unit)
    batch = replay.sample_windows(64, WINDOW)
    span = WINDOW.anchor_span
    anchors = {i: max(n - span + 1, 0) for i, n in lengths.items()}
    mass = {
        i: (a if unit == "chunk" else a > 0) * (abs(errors[i]) + EPSILON) ** ALPHA
        for i, a in anchors.items()
    }
    total = sum(mass.values())
    n_total = sum(anchors.values()) if unit == "chunk" else sum(a > 0 for a in anchors.values())
    drawn = batch.episode_ids.tolist()
    probability = np.array(
        [mass[i] / (anchors[i] if unit == "chunk" else 1) / total for i in drawn]
    )
    expected = (n_total * probability) ** -BETA
    expected /= expected.max()
    np.testing.assert_allclose(batch.weights.numpy(), expected, rtol=1e-6)
    assert batch.weights.dtype == torch.float32 and float(batch.weights.max()) == 1.0


# ----------------------------------------------------------------------- one shard
def _twins(**kwargs):
    replay = _local(1, **kwargs)
    buffer = PrioritizedSequenceReplay(4000, ALPHA, BETA, EPSILON, seed=7, **kwargs)
    for target in (replay, buffer):
        target.extend(make_episode(n, first_serial=1000 * n) for n in (3, 5, 8, 13, 4))
    return replay, buffer


@pytest.mark.parametrize("reuse_limit", [None, 25])  # 25: 125 draws, 108 taken
def test_one_shard_draws_equal_the_buffers_draw_for_draw(reuse_limit):
    """Same seed, same calls: every batch (ids, starts, data, weights) equals the buffer's."""
    replay, buffer = _twins(max_times_sampled=reuse_limit)
    for step in range(4):
        for got, expected in (
            (replay.sample_windows(12, WINDOW), buffer.sample_windows(12, WINDOW)),
            (replay.sample_prioritized(6, 3), buffer.sample_prioritized(6, 3)),
            (replay.sample(5, 2), buffer.sample(5, 2)),
            (
                replay.sample_windows(4, WINDOW, prioritized=False),
                buffer.sample_windows(4, WINDOW, prioritized=False),
            ),
        ):
            assert torch.equal(got.episode_ids, expected.episode_ids)
            assert torch.equal(got["serial"], expected["serial"])
            if getattr(expected, "weights", None) is not None:
                assert torch.equal(got.weights, expected.weights)
        errors = torch.linspace(0.1, 3.0, 12) * (step + 1)
        assert replay.update_priorities(got.episode_ids, errors[:4]) == buffer.update_priorities(
            expected.episode_ids, errors[:4]
        )
        replay.anneal_beta(step / 4)
        buffer.anneal_beta(step / 4)
    stats = replay.stats()
    assert {k: stats[k] for k in buffer.stats()} == buffer.stats()


def test_iterate_equals_successive_sample_windows_calls():
    """A stream yields the batches successive calls would (no reuse limit); one draw is
    in flight while the learner holds a batch, whatever ``prefetch``."""
    replay, _ = _twins()
    twin, _ = _twins()
    with replay.iterate(8, WINDOW, prefetch=3) as stream:
        streamed = [next(stream) for _ in range(5)]
    for batch in streamed:
        expected = twin.sample_windows(8, WINDOW)
        assert torch.equal(batch.episode_ids, expected.episode_ids)
        assert torch.equal(batch.anchor_steps, expected.anchor_steps)
        assert torch.equal(batch.weights, expected.weights)
    assert replay.stats()["chunks_sampled"] == 8 * 6  # 5 consumed, 1 in flight at close


# ----------------------------------------------------------------------------- ids
def test_ids_carry_their_shard_and_never_repeat():
    """Round robin over the shards; global ids decode to (shard, incarnation 0, local)."""
    replay = _local(3)
    issued = replay.extend(make_episode(4) for _ in range(7))
    shard, incarnation, local = ids.decode(np.array(issued))
    assert shard.tolist() == [0, 1, 2, 0, 1, 2, 0]
    assert incarnation.tolist() == [0] * 7
    assert local.tolist() == [0, 0, 0, 1, 1, 1, 2]
    assert len(set(issued)) == 7
    assert replay.add(make_episode(2)) == int(ids.encode(1, np.array(0), np.array(2)))


def test_update_priorities_routes_each_id_to_its_shard():
    """An update reaches exactly the episodes named, on their shards; duplicates take max."""
    replay = _local(2)
    first, _, third = replay.extend(make_episode(5) for _ in range(3))
    assert replay.update_priorities([third, first, third], [4.0, 2.0, 9.0]) == 2
    assert _buffer(replay, 0).priorities.tolist() == pytest.approx([2.0, 9.0], abs=1e-5)
    assert _buffer(replay, 1).priorities.tolist() == [1.0]


def test_never_issued_ids_are_refused_with_nothing_updated_on_any_shard():
    """A negative id, an unknown shard, a local id beyond the shard's and an incarnation
    that never ran are each refused; no shard changes."""
    replay = _local(2)
    issued = replay.extend(make_episode(5) for _ in range(4))
    before = [snapshot(_buffer(replay, k)) for k in range(2)]
    never = [
        -1,
        int(ids.encode(5, np.array(0), np.array(0))),
        int(ids.encode(1, np.array(0), np.array(2))),
        int(ids.encode(0, np.array(1), np.array(0))),
    ]
    for bad in never:
        with pytest.raises(InvalidArgumentError, match="issued episode id"):
            replay.update_priorities([issued[0], bad], [3.0, 3.0])
    assert [snapshot(_buffer(replay, k)) for k in range(2)] == before
    with pytest.raises(InvalidArgumentError, match=r"errors\[1\] must be finite"):
        replay.update_priorities(issued[:2], [1.0, float("nan")])


def test_evicted_ids_are_skipped_and_counted():
    """Ids evicted from their shard apply nowhere and count as skipped."""
    replay = ShardedReplay.create(2, 20, seed=0, backend="local")
    issued = replay.extend(make_episode(5) for _ in range(6))  # 2 per shard fit
    assert replay.update_priorities(issued, [2.0] * 6) == 4
    assert replay.stats()["priority_updates_skipped"] == 2


def test_the_maximum_priority_is_global():
    """A priority set on one shard is what the next episode on every shard starts with."""
    replay = _local(2)
    first, _ = replay.extend(make_episode(5) for _ in range(2))
    replay.update_priorities([first], [50.0])
    _, on_second = replay.extend(make_episode(5) for _ in range(2))
    assert on_second >> 55 == 1
    assert _buffer(replay, 1).priorities.tolist()[-1] == pytest.approx(50.0, abs=1e-5)


def test_a_draw_beyond_the_global_reuse_limit_draws_nothing_anywhere():
    """ReuseLimitError when every shard together has fewer draws left; nothing changes."""
    replay = _local(2, max_times_sampled=1)
    replay.extend(make_episode(4) for _ in range(3))
    replay.sample_windows(2, Window(3))
    before = [snapshot(_buffer(replay, k)) for k in range(2)]
    rng = replay._state.rng.bit_generator.state
    with pytest.raises(ReuseLimitError, match=r"draws left .* \(1\), got 2"):
        replay.sample_windows(2, Window(3))
    assert [snapshot(_buffer(replay, k)) for k in range(2)] == before
    assert replay._state.rng.bit_generator.state == rng
    assert replay.sample_windows(1, Window(3)).batch_size == 1


def test_draws_are_refused_as_the_single_buffer_refuses_them():
    """Empty replay, a span longer than every stored episode: the buffer's messages."""
    replay = _local(3)
    with pytest.raises(InvalidArgumentError, match="non-empty to sample"):
        replay.sample(2, 3)
    replay.extend(make_episode(4) for _ in range(2))
    with pytest.raises(InvalidArgumentError, match=r"longest stored episode \(4 steps\)"):
        replay.sample_windows(2, Window(5))
    with pytest.raises(TypeError, match="episode must be an Episode"):
        replay.add("not an episode")  # type: ignore[arg-type]


def test_every_shard_keeps_the_schema_the_first_episode_fixed():
    """An episode another shard would store under another schema is refused (TypeError)."""
    replay = _local(2)
    replay.add(make_episode(4))
    odd = make_episode(4)
    odd = type(odd)({**odd.steps, "obs": odd["obs"].double()})
    with pytest.raises(TypeError, match="obs"):
        replay.add(odd)  # would be the first episode of shard 1
    assert replay.stats()["episodes_added"] == 1
    assert replay.add(make_episode(4)) >> 55 == 1  # the refused call routed nothing


# ---------------------------------------------------------------------- persistence
def test_save_then_load_continues_exactly(tmp_path):
    """A loaded replay draws and issues ids exactly as the saved one goes on to."""
    replay, _, _ = _uneven("chunk")
    replay.sample_windows(16, WINDOW)
    replay.anneal_beta(0.5)
    replay.save(tmp_path / "saved")
    loaded = ShardedReplay.load(tmp_path / "saved")
    assert (loaded.backend, loaded.num_shards, loaded.beta) == ("local", 4, replay.beta)
    for target in (replay, loaded):
        target.extend(make_episode(n, first_serial=100 * n) for n in (6, 7))
    for _ in range(3):
        got, expected = loaded.sample_windows(16, WINDOW), replay.sample_windows(16, WINDOW)
        assert torch.equal(got.episode_ids, expected.episode_ids)
        assert torch.equal(got.weights, expected.weights)
        loaded.update_priorities(got.episode_ids, torch.arange(16.0))
        replay.update_priorities(expected.episode_ids, torch.arange(16.0))
    assert loaded.add(make_episode(3)) == replay.add(make_episode(3))
    totals = [{k: v for k, v in r.stats().items() if k != "shards"} for r in (loaded, replay)]
    assert totals[0] == totals[1]


def test_load_refuses_a_directory_that_is_not_a_saved_replay(tmp_path):
    """A manifest that does not match its checksum is a CheckpointError."""
    replay = _local(2)
    replay.add(make_episode(4))
    replay.save(tmp_path)
    manifest = tmp_path / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"beta": 0.5', '"beta": 0.6'))
    with pytest.raises(ValueError, match="checksum"):
        ShardedReplay.load(tmp_path)


def test_a_restarted_shard_reloads_its_checkpoint_and_counts_what_was_lost(tmp_path):
    """After a restart the shard holds its last checkpoint, issues ids of a new incarnation,
    skips stale ids of lost episodes, and stats count the loss."""
    replay = _local(2, checkpoint_dir=tmp_path, checkpoint_every=2)
    kept = replay.extend(make_episode(4) for _ in range(4))  # 2 per shard: checkpointed
    lost = replay.extend(make_episode(4) for _ in range(2))  # 1 per shard, not saved
    settings = replay._shards[0].target.settings
    control = replay._control
    replay._shards[0] = LocalHandle(ReplayShard(0, settings, control, restarted=True))
    stats = replay.stats()
    assert stats["episodes_lost"] == 1 and stats["transitions_lost"] == 4
    assert stats["shards"][0]["incarnation"] == 1
    assert stats["shards"][0]["episodes_stored"] == 2
    fresh = replay.extend(make_episode(4) for _ in range(2))
    assert ids.decode(np.array(fresh))[1].tolist() == [1, 0]  # shard 0 is in incarnation 1
    assert ids.decode(np.array(fresh))[2].tolist() == [2, 3]  # shard 0 re-issues local 2
    assert fresh[0] != lost[0] and fresh[0] & ids.MAX_LOCAL == lost[0] & ids.MAX_LOCAL
    stale = lost[0]  # same local number as fresh[0], older incarnation
    assert replay.update_priorities([stale, kept[0]], [30.0, 2.0]) == 1
    assert _buffer(replay, 0).priorities.tolist() == pytest.approx([2.0, 1.0, 1.0], abs=1e-5)
    batch = replay.sample_windows(200, Window(2))
    drawn = set(batch.episode_ids.tolist())
    assert stale not in drawn and fresh[0] in drawn


def _restart(replay: ShardedReplay, shard: int) -> None:
    """What Ray does to a shard that died: a new one from its restart file, same control."""
    settings = replay._shards[shard].target.settings
    replay._shards[shard] = LocalHandle(
        ReplayShard(shard, settings, replay._control, restarted=True)
    )


def test_after_a_restart_ids_the_old_incarnation_never_issued_are_refused(tmp_path):
    """Incarnation 0 of shard 1 issued local ids 0..2 and was replaced after a checkpoint at
    2: its id 2 was lost (skipped, counted), its id 40 was never issued (refused, nothing
    updated on any shard), also after a save and a load."""
    replay = _local(2, checkpoint_dir=tmp_path / "restart", checkpoint_every=2)
    kept = replay.extend(make_episode(4) for _ in range(4))  # 2 per shard: checkpointed
    lost = replay.extend(make_episode(4) for _ in range(2))  # 1 per shard, not saved
    _restart(replay, 1)
    never = int(ids.encode(1, np.array(0), np.array(40)))
    replay.save(tmp_path / "saved")
    loaded = ShardedReplay.load(tmp_path / "saved")
    for target in (replay, loaded):
        before = [snapshot(_buffer(target, k)) for k in range(2)]
        skipped = target.stats()["priority_updates_skipped"]
        with pytest.raises(InvalidArgumentError, match=r"indices\[1\] must be an issued episode"):
            target.update_priorities([kept[0], never], [5.0, 5.0])
        assert [snapshot(_buffer(target, k)) for k in range(2)] == before
        assert target.stats()["priority_updates_skipped"] == skipped
        assert target.update_priorities([kept[0], lost[1]], [5.0, 5.0]) == 1
        assert target.stats()["priority_updates_skipped"] == skipped + 1
        fresh = target.extend(make_episode(4) for _ in range(2))[1]
        assert ids.decode(np.array([fresh]))[1].tolist() == [1]
        assert target.update_priorities([fresh, kept[1]], [2.0, 3.0]) == 2


# -------------------------------------------------------------------- collecting
def test_episode_writer_adds_through_the_client():
    """EpisodeWriter takes the client as its buffer and returns global ids."""
    replay = _local(2)
    writer = EpisodeWriter(replay, num_envs=2)
    writer.reset(np.zeros((2, 1)))
    stored = writer.step(
        np.array([1, 0]),
        np.array([1.0, 1.0]),
        np.array([True, True]),
        np.array([False, False]),
        np.ones((2, 1)),
    )
    assert sorted(i >> 55 for i in stored) == [0, 1]
    assert replay.stats()["transitions_stored"] == 4


def test_a_local_client_refuses_to_pickle_and_a_closed_one_to_work():
    """Pickling copies nothing in-process; calls after close are refused."""
    import pickle

    replay = _local(2)
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(replay)
    replay.close()
    with pytest.raises(InvalidArgumentError, match="closed"):
        replay.add(make_episode(3))


def test_the_scaling_out_guide_runs_and_prints_what_it_states():
    """docs/guides/scaling-out.md: its python blocks run in order and print what they say."""
    from test_guides import BLOCK, GUIDES, _expected_output

    namespace: dict[str, object] = {"__name__": "guide_scaling_out"}
    blocks = BLOCK.findall((GUIDES / "scaling-out.md").read_text(encoding="utf-8"))
    assert len(blocks) >= 3
    for number, block in enumerate(blocks):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(block, f"scaling-out.md, block {number}", "exec"), namespace)
        assert printed.getvalue().splitlines() == _expected_output(block), f"block {number}"


def test_write_back_reaches_each_records_shard():
    """Per-record values land in the stored field of each record's own shard and episode."""
    replay = _local(2)
    replay.extend(make_episode(6) for _ in range(4))
    batch = replay.sample_windows(6, WINDOW)
    values = torch.stack([batch["obs"][..., 0] * 0 + 7.0, -batch["obs"][..., 1]], dim=-1)
    written = replay.write_back(batch, "obs", values)
    assert written == int(batch.validity_mask.sum())
    again = replay.sample_windows(50, WINDOW)
    touched = {
        (i, s)
        for i, s in zip(
            batch.record_episode_ids[batch.validity_mask].tolist(),
            batch.record_steps[batch.validity_mask].tolist(),
            strict=True,
        )
    }
    first = again["obs"][..., 0][again.validity_mask]
    pairs = zip(
        again.record_episode_ids[again.validity_mask].tolist(),
        again.record_steps[again.validity_mask].tolist(),
        strict=True,
    )
    for value, pair in zip(first.tolist(), pairs, strict=True):
        assert (value == 7.0) == (pair in touched)


@pytest.mark.statistical
def test_the_reuse_limit_across_shards_draws_as_sequential_draws_without_replacement():
    """max_times_sampled=1, B=2 over 3 episodes on 2 shards: ordered pairs (a, b) come with
    probability m_a / Z * m_b / (Z - m_a), the single buffer's sequential law."""
    masses = np.array([1.0, 2.0 * 2, 4.0 * 3])  # p^alpha (alpha 1) times anchors (1, 2, 3)
    pairs = [(a, b) for a in range(3) for b in range(3) if a != b]
    law = np.array([masses[a] / masses.sum() * masses[b] / (masses.sum() - masses[a])
                    for a, b in pairs])  # fmt: skip
    counts = dict.fromkeys(pairs, 0)
    for trial in range(2_000):
        replay = ShardedReplay.create(
            2, 200, alpha=1.0, epsilon=EPSILON, seed=trial, backend="local", max_times_sampled=1
        )
        issued = replay.extend(make_episode(n) for n in (3, 4, 5))  # shards 0, 1, 0
        replay.update_priorities(issued, [1.0, 2.0, 4.0])
        drawn = replay.sample_windows(2, Window(3)).episode_ids.tolist()
        counts[(issued.index(drawn[0]), issued.index(drawn[1]))] += 1
    observed = np.array([counts[pair] for pair in pairs])
    assert scipy.stats.chisquare(observed, observed.sum() * law).pvalue > ACCEPT
    iid = np.array([masses[a] * masses[b] for a, b in pairs])  # ignoring the exhaustion
    assert scipy.stats.chisquare(observed, observed.sum() * iid / iid.sum()).pvalue < REJECT


def test_a_restart_never_reloads_another_replays_file(tmp_path):
    """A new replay checkpoints its shards at once: an old file in checkpoint_dir is replaced."""
    old = _local(1, checkpoint_dir=tmp_path, checkpoint_every=1)
    old.extend(make_episode(4) for _ in range(3))
    new = _local(1, checkpoint_dir=tmp_path, checkpoint_every=5)
    settings, control = new._shards[0].target.settings, new._control
    new._shards[0] = LocalHandle(ReplayShard(0, settings, control, restarted=True))
    assert new.stats()["episodes_stored"] == 0
