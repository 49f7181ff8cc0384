"""Stacked fields on real Atari frames equal gymnasium's ``FrameStackObservation``.

A few hundred steps of Breakout and Pong (ale-py's bundled ROMs, ``AtariPreprocessing``:
84x84 grayscale, frame skip 4) are played with fixed seeds and actions through
``FrameStackObservation(env, 4)`` for each padding; each step's own frame (the stack's last)
is stored once, and every gathered stack must equal what the wrapper returned for that step.
Nothing is cached on disk.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lucid_replay import Episode, Field, SequenceReplay, Window

ale_py = pytest.importorskip("ale_py")
gym = pytest.importorskip("gymnasium")
pytest.importorskip("cv2")  # AtariPreprocessing's resize

FRAMES = 4
PADS = {"same": "reset", "zeros": "zero"}  # ours -> gymnasium's padding_type


def play(game: str, padding: str, steps: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Episodes of ``steps`` steps in all: (stacked observations ``[T + 1, 4, 84, 84]``,
    actions ``[T + 1]``)."""
    from gymnasium.wrappers import AtariPreprocessing, FrameStackObservation

    gym.register_envs(ale_py)
    env = gym.make(f"ALE/{game}-v5", frameskip=1)  # AtariPreprocessing skips frames itself
    env = AtariPreprocessing(env, frame_skip=4, screen_size=84, terminal_on_life_loss=True)
    env = FrameStackObservation(env, FRAMES, padding_type=padding)
    rng = np.random.default_rng(0)
    episodes, observations, actions = [], [env.reset(seed=0)[0]], []
    for _ in range(steps):
        action = int(rng.integers(env.action_space.n))
        observation, _, terminated, truncated, _ = env.step(action)
        observations.append(observation)
        actions.append(action)
        if terminated or truncated:
            episodes.append((np.stack(observations), np.array([*actions, 0])))
            observations, actions = [env.reset()[0]], []
    episodes.append((np.stack(observations), np.array([*actions, 0])))
    env.close()
    return episodes


@pytest.mark.parametrize("game", ["Breakout", "Pong"])
@pytest.mark.parametrize(("pad", "codec"), [("same", None), ("zeros", None), ("same", "zstd")])
def test_stacks_equal_frame_stack_observation(game: str, pad: str, codec: str | None) -> None:
    """Every record's stack (from step 0, clamped ones included) is the wrapper's observation,
    compressed or not."""
    if codec is not None:
        pytest.importorskip("zstandard")
    played = play(game, PADS[pad], 150 if game == "Pong" else 250)
    schema = {
        "obs": Field((84, 84), torch.uint8, stack=FRAMES, stack_pad=pad, codec=codec),
        "action": ((), torch.int64),
    }
    buffer = SequenceReplay(2_000, schema=schema, seed=0)
    expected = {}
    for stacked, actions in played:
        frames = torch.from_numpy(stacked[:, -1])  # each step's own frame: stored once
        episode_id = buffer.add(Episode({"obs": frames, "action": torch.from_numpy(actions)}))
        expected[episode_id] = torch.from_numpy(stacked)
    report = buffer.memory_report()["fields"]["obs"]
    assert report["raw_bytes"] == len(buffer) * 84 * 84
    if codec is not None:  # real frames: blocks over ten times smaller, besides the one
        head = 32 * 84 * 84  # block being written, kept raw
        assert (report["stored_bytes"] - head) * 10 < report["raw_bytes"]

    for episode_id, stacked in expected.items():  # every step as an anchor, from step 0 on
        steps = torch.arange(stacked.shape[0])
        window = Window(2, burn_in=3, bootstrap=1)  # clamped before the start and past the end
        batch = buffer.gather_windows(torch.full_like(steps, episode_id), steps, window)
        assert torch.equal(batch.data["obs"], stacked[batch.record_steps])

    batch = buffer.sample_windows(64, Window(8, burn_in=4, boundary="include_reset"))
    for b, k in np.ndindex(*batch.record_steps.shape):
        episode_id, step = int(batch.record_episode_ids[b, k]), int(batch.record_steps[b, k])
        assert torch.equal(batch.data["obs"][b, k], expected[episode_id][step])
