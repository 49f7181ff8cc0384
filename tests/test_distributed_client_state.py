"""The client's own state (`ClientState`): what a copy keeps, what a checkpoint saves."""

from __future__ import annotations

import pickle

import numpy as np

from lucid_replay.distributed.client_state import ClientState


def _used(state: ClientState) -> ClientState:
    state.rng.random(5)
    state.cursor, state.global_max, state.skipped, state.changes = 3, 7.5, 2, 9
    state.issued[-1] = (0, 4, [0], [])
    state.deferred[-1].append((np.array([1]), np.array([0.5])))
    return state


def test_a_fresh_state_knows_no_marks_and_queues_nothing():
    state = ClientState(np.random.default_rng(0), 0.4, 3)
    assert state.issued == [None] * 3 and state.issued_segments == [None] * 3
    assert state.deferred == [[], [], []] and state.deferred[0] is not state.deferred[1]
    assert (state.cursor, state.global_max, state.skipped, state.changes) == (0, 1.0, 0, 0)


def test_a_copy_keeps_beta_the_maximum_and_the_skipped_count_and_draws_its_own_labels():
    state = _used(ClientState(np.random.default_rng(0), 0.4, 4))
    copies = [state.for_copy() for _ in range(2)]
    for copy in copies:
        assert (copy.beta, copy.global_max, copy.skipped) == (0.4, 7.5, 2)
        assert copy.issued == [None] * 4 and copy.deferred == [[]] * 4
        assert copy.changes == 0 and 0 <= copy.cursor < 4
    states = [c.rng.bit_generator.state["state"] for c in (state, *copies)]
    assert len({s["state"] for s in states}) == 3  # three generators, none shared


def test_saved_entries_adopted_by_a_fresh_state_restore_it_exactly():
    state = _used(ClientState(np.random.default_rng(0), 0.7, 2))
    fresh = ClientState(np.random.default_rng(99), 0.4, 2)
    fresh.adopt(pickle.loads(pickle.dumps(state.saved())))
    assert (fresh.beta, fresh.cursor, fresh.global_max, fresh.skipped) == (0.7, 3, 7.5, 2)
    assert fresh.rng.random(4).tolist() == state.rng.random(4).tolist()
