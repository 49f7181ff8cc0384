"""The replays conform to `ReplayLike` / `PrioritizedReplayLike` / `Adds`.

``mypy`` checks the signatures statically (`lucid_replay.distributed.conformance`); these
tests check the same at run time, where a user's ``isinstance`` and ``inspect`` look.
"""

from __future__ import annotations

import inspect

import pytest

from lucid_replay import (
    Adds,
    EpisodeWriter,
    PrioritizedReplayLike,
    PrioritizedSequenceReplay,
    ReplayLike,
    SequenceReplay,
)
from lucid_replay.distributed import ShardedReplay


@pytest.fixture(scope="module")
def sharded():
    replay = ShardedReplay.create(2, 100, seed=0, backend="local")
    yield replay
    replay.close()


def test_every_replay_is_replay_like_and_only_prioritized_ones_are_prioritized(sharded) -> None:
    uniform, prioritized = SequenceReplay(100), PrioritizedSequenceReplay(100)
    for replay in (uniform, prioritized, sharded):
        assert isinstance(replay, ReplayLike)
        assert isinstance(replay, Adds)
    assert isinstance(prioritized, PrioritizedReplayLike)
    assert isinstance(sharded, PrioritizedReplayLike)
    assert not isinstance(uniform, PrioritizedReplayLike)


def _members(protocol: type) -> dict[str, inspect.Signature]:
    names = {
        name
        for klass in protocol.__mro__
        if klass.__dict__.get("_is_protocol")
        for name, value in klass.__dict__.items()
        if inspect.isfunction(value)
        and (not name.startswith("_") or name == "__len__")
        and name != "__init__"
    }
    return {name: inspect.signature(getattr(protocol, name)) for name in names}


@pytest.mark.parametrize(
    ("klass", "protocol"),
    [
        (SequenceReplay, ReplayLike),
        (PrioritizedSequenceReplay, PrioritizedReplayLike),
        (ShardedReplay, PrioritizedReplayLike),
    ],
)
def test_each_call_takes_the_protocols_arguments_with_its_defaults(klass, protocol) -> None:
    """Positional parameters in the same places, the protocol's keywords with the same
    defaults; a class's own extra keywords must have defaults."""
    members = _members(protocol)
    assert {"sample_windows", "iterate", "save", "__len__"} <= set(members)
    for name, expected in members.items():
        actual = inspect.signature(getattr(klass, name))
        want = list(expected.parameters.values())[1:]
        have = list(actual.parameters.values())[1:]
        positional = [p for p in want if p.kind is p.POSITIONAL_ONLY]
        assert len(have) >= len(positional), (klass.__name__, name)
        for p, q in zip(positional, have, strict=False):
            assert q.kind in (q.POSITIONAL_ONLY, q.POSITIONAL_OR_KEYWORD), (name, q)
            assert p.default == q.default, (klass.__name__, name, p.name)
        keywords = {p.name: p for p in want if p.kind is p.KEYWORD_ONLY}
        own = {q.name: q for q in have[len(positional) :]}
        for key, p in keywords.items():
            assert key in own, (klass.__name__, name, key)
            assert own[key].default == p.default, (klass.__name__, name, key)
        for key, q in own.items():
            if key not in keywords:
                assert q.default is not q.empty, (klass.__name__, name, key)


def test_a_writer_accepts_any_object_that_adds() -> None:
    class Recorder:
        def __init__(self) -> None:
            self.episodes: list[object] = []

        def add(self, episode: object) -> int:
            self.episodes.append(episode)
            return len(self.episodes) - 1

    recorder = Recorder()
    assert isinstance(recorder, Adds)
    EpisodeWriter(recorder, 2)  # typed as Adds: no extend, no schema needed
