"""Real Atari frames for the pixel benchmarks, collected once and cached on disk.

``python -m benchmarks.atari [--steps 200000] [--games Pong,Breakout,MsPacman]`` plays each
game with a seeded uniformly random policy through gymnasium's ``AtariPreprocessing`` (84x84
grayscale, frame skip 4, no frame stacking: stacks are the buffer's job) and keeps each
episode's observations (``T + 1`` frames), actions, rewards and terminal flag. The frames are
ale-py's own (0.12.1 ships the ROMs). A game's steps go to ``<cache>/<game>-<steps>.npz``
(uncompressed, ~7 KB a step); ``LUCID_ATARI_CACHE`` overrides the cache directory
(default ``~/.cache/lucid_replay/atari``), so later runs load instead of playing.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np

__all__ = ["GAMES", "AtariSteps", "cache_directory", "collect", "load"]

GAMES = ("Pong", "Breakout", "MsPacman")
FRAME = (84, 84)
_ARRAYS = ("frames", "actions", "rewards", "lengths", "terminated")


class AtariSteps:
    """One game's collected steps, episode by episode (``frames`` has ``T + 1`` per episode)."""

    def __init__(self, game: str, arrays: dict[str, np.ndarray]) -> None:
        self.game = game
        self.frames = arrays["frames"]  # uint8 [sum(T + 1), 84, 84]
        self.actions = arrays["actions"]  # int64 [sum(T)]
        self.rewards = arrays["rewards"]  # float32 [sum(T)]
        self.lengths = arrays["lengths"]  # int64 [episodes]: T of each
        self.terminated = arrays["terminated"]  # bool [episodes]

    @property
    def transitions(self) -> int:
        return int(self.lengths.sum())

    def episodes(self) -> list[dict[str, np.ndarray | bool]]:
        """Each episode's ``frames`` (``[T + 1, 84, 84]``), ``actions``, ``rewards``."""
        out: list[dict[str, np.ndarray | bool]] = []
        frame = step = 0
        for length, terminated in zip(self.lengths.tolist(), self.terminated.tolist(), strict=True):
            out.append(
                {
                    "frames": self.frames[frame : frame + length + 1],
                    "actions": self.actions[step : step + length],
                    "rewards": self.rewards[step : step + length],
                    "terminated": bool(terminated),
                }
            )
            frame, step = frame + length + 1, step + length
        return out


def cache_directory() -> Path:
    default = Path.home() / ".cache" / "lucid_replay" / "atari"
    return Path(os.environ.get("LUCID_ATARI_CACHE", default))


def collect(game: str, steps: int, seed: int = 0) -> AtariSteps:
    """Play ``game`` randomly until ``steps`` transitions are collected (whole episodes)."""
    import ale_py
    import gymnasium as gym
    from gymnasium.wrappers import AtariPreprocessing

    gym.register_envs(ale_py)
    env = AtariPreprocessing(
        gym.make(f"ALE/{game}-v5", frameskip=1), frame_skip=4, screen_size=84, grayscale_obs=True
    )
    rng = np.random.default_rng(seed)
    actions_count = int(env.action_space.n)  # type: ignore[attr-defined]  # Discrete
    frames, actions, rewards, lengths, terminals = [], [], [], [], []
    collected, episode = 0, 0
    while collected < steps:
        observation, _ = env.reset(seed=seed + episode)
        frames.append(observation)
        length, done = 0, False
        while not done:
            action = int(rng.integers(actions_count))
            observation, reward, terminated, truncated, _ = env.step(action)
            frames.append(observation)
            actions.append(action)
            rewards.append(reward)
            length += 1
            done = terminated or truncated
        lengths.append(length)
        terminals.append(terminated)
        collected += length
        episode += 1
    env.close()
    arrays: dict[str, np.ndarray] = {
        "frames": np.stack(frames).astype(np.uint8),
        "actions": np.asarray(actions, dtype=np.int64),
        "rewards": np.asarray(rewards, dtype=np.float32),
        "lengths": np.asarray(lengths, dtype=np.int64),
        "terminated": np.asarray(terminals, dtype=bool),
    }
    return AtariSteps(game, arrays)


def load(game: str, steps: int) -> AtariSteps:
    """``game``'s cached steps (at least ``steps``), collected and cached first if missing."""
    path = cache_directory() / f"{game}-{steps}.npz"
    if path.exists():
        with np.load(path) as arrays:
            loaded: dict[str, np.ndarray] = {name: arrays[name] for name in arrays.files}
            return AtariSteps(game, loaded)
    data = collect(game, steps)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".partial.npz")
    np.savez(temporary, **{name: getattr(data, name) for name in _ARRAYS})
    os.replace(temporary, path)
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200_000)
    parser.add_argument("--games", default=",".join(GAMES))
    options = parser.parse_args()
    for game in options.games.split(","):
        began = time.perf_counter()
        data = load(game, options.steps)
        print(
            f"{game}: {data.transitions} transitions in {len(data.lengths)} episodes "
            f"({time.perf_counter() - began:.0f} s)"
        )


if __name__ == "__main__":
    main()
