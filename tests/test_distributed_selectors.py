"""`ShardedReplay` with ``selector=``, ``schema=`` and ``storage=`` (backend="local").

The statistical tests draw anchors from four uneven shards (one empty, one holding only
episodes too short for the span, one at 10x the priority) and compare the (episode, start)
frequencies with the exact law over the union of the shards, enumerated anchor by anchor
(chi-square, accepted at p > ACCEPT); the reported probabilities equal that law's P.
`Recency` ages by the transitions added to every shard (see test_distributed_recency.py).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import scipy.stats
import torch
from conftest import both_engines, make_episode

from lucid_replay import (
    Episode,
    Field,
    InvalidArgumentError,
    InvalidTypeError,
    Mixture,
    Prioritized,
    PrioritizedSequenceReplay,
    Recency,
    Uniform,
    Window,
)
from lucid_replay.distributed import ShardedReplay, backends, transport
from lucid_replay.distributed.calls import LocalHandle, get
from lucid_replay.distributed.shards import ReplayShard

ACCEPT = 1e-3
REJECT = 1e-6
ALPHA, BETA, EPSILON = 0.7, 0.5, 1e-6
WINDOW = Window(3, burn_in=2, bootstrap=1)  # anchor span 3
MIXTURE = Mixture({Prioritized(): 0.6, Uniform(): 0.4})
HALF_LIFE = 16  # transitions: the uneven shards' commit counters span 2 .. 54
RECENT = Mixture({Prioritized(): 0.5, Recency(HALF_LIFE): 0.5})
SELECTORS = {
    "prioritized": Prioritized(),
    "uniform": Uniform(),
    "mixture": MIXTURE,
    "recency": Recency(HALF_LIFE),
    "recent mixture": RECENT,
}


# ------------------------------------------------------------------------------ helpers
def _local(num_shards: int = 4, **kwargs: object) -> ShardedReplay:
    options = {"alpha": ALPHA, "beta": BETA, "epsilon": EPSILON, "seed": 7, **kwargs}
    return ShardedReplay.create(num_shards, 4000, backend="local", **options)


def _add_to(replay: ShardedReplay, shard: int, *lengths: int) -> list[int]:
    packed = [transport.pack_episode(make_episode(n)) for n in lengths]
    return [int(i) for i in get(replay._shards[shard].add.remote(packed))]


def _uneven(selector, unit: str = "chunk"):
    """Shard 0 empty, shard 1 only short episodes, shard 2 at 10x priority, shard 3 plain."""
    replay = _local(unit=unit, selector=selector)
    lengths: dict[int, int] = {}
    for shard, episode_lengths in ((1, (2, 2, 1)), (2, (4, 7, 3)), (3, (5, 9, 6, 3, 12))):
        stored = _add_to(replay, shard, *episode_lengths)
        lengths.update(zip(stored, episode_lengths, strict=True))
    errors = {i: (10.0 if i >> 55 == 2 else 1.0) * (1 + (i % 3)) for i in lengths}
    replay.update_priorities(list(errors), list(errors.values()))
    return replay, lengths, errors


def _component(selector, lengths, errors, span: int, unit: str) -> dict[tuple[int, int], float]:
    """P(episode, start) of one component over every shard's anchors.

    `Recency`: ``lengths`` lists the episodes in the order they were added (to any shard),
    so an episode's commit counter is the replay's transitions up to its own.
    """
    mass = {}
    commits = dict(zip(lengths, np.cumsum(list(lengths.values())).tolist(), strict=True))
    for episode_id, n in lengths.items():
        anchors = max(n - span + 1, 0)
        if not anchors:
            continue
        if isinstance(selector, Recency):
            m = 2.0 ** ((commits[episode_id] - max(commits.values())) / selector.half_life)
        elif isinstance(selector, Uniform):
            m = 1.0
        else:
            m = (abs(errors[episode_id]) + EPSILON) ** ALPHA
        for start in range(anchors):  # an episode counts once for unit="episode"
            mass[episode_id, start] = m if unit == "chunk" else m / anchors
    total = sum(mass.values())
    return {cell: m / total for cell, m in mass.items()}


def _law(selector, lengths, errors, span: int = WINDOW.anchor_span, unit: str = "chunk"):
    """The exact law of ``selector`` over the union: cells and their probabilities."""
    parts = selector.components if isinstance(selector, Mixture) else ((selector, 1.0),)
    law: dict[tuple[int, int], float] = {}
    for part, fraction in parts:
        for cell, p in _component(part, lengths, errors, span, unit).items():
            law[cell] = law.get(cell, 0.0) + fraction * p
    return law


def _counts(replay, cells, draws: int, *, chunks: bool = False, batch: int = 2_000):
    index = {cell: at for at, cell in enumerate(cells)}
    counts = np.zeros(len(cells))
    for _ in range(draws // batch):
        drawn = (
            replay.sample_prioritized(batch, WINDOW.anchor_span)
            if chunks
            else replay.sample_windows(batch, WINDOW)
        )
        starts = drawn.starts if chunks else drawn.anchor_steps
        pairs = zip(drawn.episode_ids.tolist(), starts.tolist(), strict=True)
        np.add.at(counts, [index[pair] for pair in pairs], 1)
    return counts


# --------------------------------------------------------------------------- the law
@pytest.mark.statistical
@pytest.mark.parametrize("name", list(SELECTORS))
def test_cross_shard_draws_follow_the_selectors_law_over_every_shard(name):
    """(episode, start) frequencies over 100k draws match the selector's law over the union
    of the shards, and reject the laws of the other selectors."""
    replay, lengths, errors = _uneven(SELECTORS[name])
    law = _law(SELECTORS[name], lengths, errors)
    cells = list(law)
    expected = np.array([law[c] for c in cells])
    counts = _counts(replay, cells, 100_000)
    assert counts.sum() == 100_000
    assert scipy.stats.chisquare(counts, counts.sum() * expected).pvalue > ACCEPT
    for other in SELECTORS:
        if other != name:
            wrong = _law(SELECTORS[other], lengths, errors)
            wrong_expected = np.array([wrong[c] for c in cells])
            assert scipy.stats.chisquare(counts, counts.sum() * wrong_expected).pvalue < REJECT


@pytest.mark.statistical
def test_mixture_chunks_by_episode_follow_the_law():
    """unit="episode", chunks: P(episode) = sum_k f_k m_k / Z_k, starts uniform inside."""
    replay, lengths, errors = _uneven(MIXTURE, unit="episode")
    law = _law(MIXTURE, lengths, errors, unit="episode")
    cells = list(law)
    counts = _counts(replay, cells, 60_000, chunks=True)
    expected = np.array([law[c] for c in cells])
    assert scipy.stats.chisquare(counts, counts.sum() * expected).pvalue > ACCEPT


@pytest.mark.parametrize("unit", ["chunk", "episode"])
@pytest.mark.parametrize("name", list(SELECTORS))
def test_probabilities_and_weights_are_the_global_formula(name, unit):
    """batch.probabilities is the anchor's P over every shard (rtol 1e-12); weights are
    (N P)^-beta / max over the batch; sample() reports the uniform P."""
    selector = SELECTORS[name]
    replay, lengths, errors = _uneven(selector, unit=unit)
    law = _law(selector, lengths, errors, unit=unit)
    per_episode = {}
    for (episode_id, _), p in law.items():
        per_episode[episode_id] = per_episode.get(episode_id, 0.0) + p
    batch = replay.sample_windows(256, WINDOW)
    cells = zip(batch.episode_ids.tolist(), batch.anchor_steps.tolist(), strict=True)
    if unit == "chunk":
        expected = np.array([law[cell] for cell in cells])
    else:  # P of the episode, as the single buffer reports it
        expected = np.array([per_episode[i] for i in batch.episode_ids.tolist()])
    assert batch.probabilities.dtype == torch.float64
    np.testing.assert_allclose(batch.probabilities.numpy(), expected, rtol=1e-12)
    n = len(law) if unit == "chunk" else len(per_episode)
    weights = (n * expected) ** -BETA
    np.testing.assert_allclose(batch.weights.numpy(), weights / weights.max(), rtol=1e-6)
    uniform = _law(Uniform(), lengths, errors, WINDOW.anchor_span, unit)
    chunks = replay.sample(64, WINDOW.anchor_span)
    if unit == "chunk":
        pairs = zip(chunks.episode_ids.tolist(), chunks.starts.tolist(), strict=True)
        np.testing.assert_allclose(
            chunks.probabilities.numpy(), [uniform[p] for p in pairs], rtol=1e-12
        )


# ----------------------------------------------------------------------- one shard
def _twins(selector, **kwargs):
    replay = _local(1, selector=selector, **kwargs)
    buffer = PrioritizedSequenceReplay(
        4000, ALPHA, BETA, EPSILON, seed=7, selector=selector, **kwargs
    )
    for target in (replay, buffer):
        target.extend(make_episode(n, first_serial=1000 * n) for n in (3, 5, 8, 13, 4))
    return replay, buffer


@both_engines
@pytest.mark.parametrize("reuse_limit", [None, 25])
@pytest.mark.parametrize("name", list(SELECTORS))
def test_one_shard_draws_equal_the_buffers_draw_for_draw(name, reuse_limit):
    """Same seed, same calls: ids, data, weights and probabilities equal the buffer's."""
    replay, buffer = _twins(SELECTORS[name], max_times_sampled=reuse_limit)
    assert replay.selector == buffer.selector
    for step in range(4):  # 25: 108 of the 125 draws allowed, episodes retire
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
            assert torch.equal(got.probabilities, expected.probabilities)
            if getattr(expected, "weights", None) is not None:
                assert torch.equal(got.weights, expected.weights)
        errors = torch.linspace(0.1, 3.0, 12) * (step + 1)
        replay.update_priorities(got.episode_ids, errors[:4])
        buffer.update_priorities(expected.episode_ids, errors[:4])
    stats = replay.stats()
    assert {k: stats[k] for k in buffer.stats()} == buffer.stats()


def test_a_mixture_over_shards_keeps_to_the_reuse_limit():
    """Refused positions are drawn again from their component until the batch is full;
    no episode is drawn more often than the limit, and the P reported are positive."""
    limited = _local(4, selector=MIXTURE, max_times_sampled=3)
    for shard, episode_lengths in ((1, (2, 2, 1)), (2, (4, 7, 3)), (3, (5, 9, 6, 3, 12))):
        _add_to(limited, shard, *episode_lengths)
    drawn = [limited.sample_windows(5, WINDOW) for _ in range(4)]  # 20 of 24 allowed
    ids = torch.cat([batch.episode_ids for batch in drawn])
    _, counts = torch.unique(ids, return_counts=True)
    assert ids.numel() == 20 and int(counts.max()) <= 3
    assert all(bool((batch.probabilities > 0).all()) for batch in drawn)


# ----------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"selector": "uniform"}, InvalidTypeError, "selector"),
        ({"selector": Prioritized(alpha=0.3)}, InvalidArgumentError, "alpha"),
        ({"schema": {"obs": ((2,), "float")}}, TypeError, "dtype"),
        ({"storage": "disk"}, InvalidArgumentError, "storage"),
        ({"storage": "memmap"}, InvalidArgumentError, "directory"),
        ({"directory": "somewhere"}, InvalidArgumentError, "directory"),
        ({"cache_bytes": True}, TypeError, "cache_bytes"),
    ],
)
def test_bad_options_are_refused_before_any_shard_starts(monkeypatch, kwargs, error, match):
    def started(*args: object) -> None:
        raise AssertionError("a shard started")

    monkeypatch.setattr(backends, "start", started)
    with pytest.raises(error, match=match):
        _local(2, **kwargs)


def test_a_memmap_directory_holding_anything_is_refused_before_any_shard_starts(
    tmp_path, monkeypatch
):
    (tmp_path / "other").write_text("x")
    monkeypatch.setattr(backends, "start", None)
    with pytest.raises(InvalidArgumentError, match="directory must be a new or empty"):
        _local(2, storage="memmap", directory=tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["other"]


# ---------------------------------------------------------------------- persistence
def test_save_and_load_keep_the_selector_and_the_schema(tmp_path):
    """A loaded replay draws by the same mixture with the same declared schema, and draws
    what the saved one draws next."""
    schema = {"serial": ((), torch.int64), "obs": Field((2,), torch.float32, stack=2)}
    schema["done"] = ((), torch.bool)
    replay = _local(2, selector=MIXTURE, schema=schema)
    replay.extend(make_episode(n) for n in (4, 6, 9, 5))
    replay.save(tmp_path / "saved")
    config = json.loads(next((tmp_path / "saved").glob("*.json")).read_text())
    text = json.dumps(config)
    assert "Mixture" in text and "stack" in text
    loaded = ShardedReplay.load(tmp_path / "saved")
    assert loaded.selector == replay.selector
    for a, b in ((replay, loaded),):
        first, second = a.sample_windows(32, WINDOW), b.sample_windows(32, WINDOW)
        assert torch.equal(first.episode_ids, second.episode_ids)
        assert torch.equal(first["obs"], second["obs"])
        assert torch.equal(first.probabilities, second.probabilities)
        assert tuple(first["obs"].shape) == (32, WINDOW.size, 2, 2)
    wrong = {"serial": torch.arange(3), "obs": torch.zeros(3, 5), "done": torch.zeros(3) > 0}
    with pytest.raises(ValueError, match="shape"):  # the declared schema holds on load
        loaded.add(Episode(wrong))
    replay.close()
    loaded.close()


# ------------------------------------------------------------------------- storage
def _frames(n: int, first: int) -> Episode:
    serial = torch.arange(first, first + n, dtype=torch.int64)
    obs = (serial % 251).to(torch.uint8)[:, None, None].expand(n, 3, 2).contiguous()
    return Episode({"serial": serial, "obs": obs})


def _pixel_schema(codec: str | None) -> dict[str, object]:
    return {
        "serial": ((), torch.int64),
        "obs": Field((3, 2), torch.uint8, stack=3, codec=codec),
    }


@pytest.mark.parametrize("codec", [None, "zstd"])
def test_stacked_and_compressed_fields_through_shards_equal_a_single_buffers(codec):
    """One shard: bit-identical batches to a buffer of the same schema; four shards: every
    record's stack holds its episode's frames t-2 .. t (repeating step 0)."""
    if codec is not None:
        pytest.importorskip("zstandard")
    schema = _pixel_schema(codec)
    replay = _local(1, schema=schema)
    buffer = PrioritizedSequenceReplay(4000, ALPHA, BETA, EPSILON, seed=7, schema=schema)
    episodes = [_frames(n, 1000 * (i + 1)) for i, n in enumerate((5, 9, 4, 12))]
    replay.extend(episodes)
    buffer.extend(episodes)
    got, expected = replay.sample_windows(16, WINDOW), buffer.sample_windows(16, WINDOW)
    assert torch.equal(got["obs"], expected["obs"]) and got["obs"].shape[-3:] == (3, 3, 2)
    sharded = _local(4, schema=schema)
    sharded.extend(episodes)
    batch = sharded.sample_windows(64, Window(3))
    serial = batch["serial"]
    for back in range(3):
        step = torch.maximum(serial - (2 - back), serial - serial % 1000)
        assert torch.equal(batch["obs"][:, :, back, 0, 0], (step % 251).to(torch.uint8))


def test_memmap_shards_keep_their_files_in_shard_directories(tmp_path):
    """storage="memmap": shard k's files under directory/shard_<k>; draws equal those of the
    same replay in memory; a restarted shard refills fresh files from its restart file."""
    schema = {"serial": ((), torch.int64), "obs": ((2,), torch.float32), "done": ((), torch.bool)}
    mapped = _local(
        2, storage="memmap", directory=tmp_path / "m", schema=schema, checkpoint_dir=tmp_path
    )
    memory = _local(2, schema=schema)
    episodes = [make_episode(n, first_serial=1000 * n) for n in (4, 6, 9, 5)]
    lengths = dict(zip(mapped.extend(episodes), (4, 6, 9, 5), strict=True))
    memory.extend(episodes)
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["shard_0", "shard_1"]
    assert any((tmp_path / "m" / "shard_1").iterdir())
    a, b = mapped.sample_windows(32, WINDOW), memory.sample_windows(32, WINDOW)
    assert torch.equal(a.episode_ids, b.episode_ids) and torch.equal(a["obs"], b["obs"])
    mapped.save(tmp_path)  # restart files now hold every episode
    settings = mapped._shards[0].target.settings
    mapped._shards[0] = LocalHandle(ReplayShard(0, settings, mapped._control, restarted=True))
    stats = mapped.stats()
    assert stats["episodes_lost"] == 0 and stats["shards"][0]["episodes_stored"] == 2
    drawn = mapped.sample_windows(200, WINDOW)  # never another episode's data
    first = torch.tensor([1000 * lengths[i] for i in drawn.episode_ids.tolist()])
    assert torch.equal(drawn["serial"][:, WINDOW.burn_in], first + drawn.anchor_steps)
    with pytest.raises(InvalidArgumentError, match="directory must be a new or empty"):
        ShardedReplay.load(tmp_path)
    loaded = ShardedReplay.load(tmp_path, storage_directory=tmp_path / "again")
    assert sorted(p.name for p in (tmp_path / "again").iterdir()) == ["shard_0", "shard_1"]
    assert len(loaded) == len(memory)


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("selector", {"Recency": 5.0}, "selector"),
        ("selector", "Sometimes", "selector"),
        ("schema", {"obs": [[2], "float99"]}, "dtype"),
        ("storage", "disk", "storage"),
    ],
)
def test_a_manifest_with_a_bad_selector_schema_or_storage_is_refused(tmp_path, key, value, match):
    """A manifest whose options create would refuse is a CheckpointError; nothing starts."""
    from test_distributed_checkpoints import _rewrite, _set

    from lucid_replay import CheckpointError

    replay = _local(2, selector=MIXTURE)
    replay.extend(make_episode(n) for n in (4, 6))
    replay.save(tmp_path)
    _rewrite(tmp_path, _set("config", key, value=value))
    with pytest.raises(CheckpointError, match=match):
        ShardedReplay.load(tmp_path)


def test_storage_directory_is_refused_for_a_replay_saved_in_memory(tmp_path):
    replay = _local(2)
    replay.extend(make_episode(n) for n in (4, 6))
    replay.save(tmp_path / "saved")
    with pytest.raises(InvalidArgumentError, match="storage_directory must be None"):
        ShardedReplay.load(tmp_path / "saved", storage_directory=tmp_path / "files")
    assert not (tmp_path / "files").exists()
