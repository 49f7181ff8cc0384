"""Atari frames into a compressed, frame-stacking replay: how much memory, how fast to sample.

Four Pong environments (gymnasium's ``AtariPreprocessing``: 84x84 grayscale, frame skip 4,
no frame stacking) are stepped by a uniformly random policy, and an ``EpisodeWriter`` turns
their step stream into whole episodes in a ``SequenceReplay`` whose observation field is
``Field((84, 84), torch.uint8, stack=4, codec="zstd")``:

* each step stores its own frame once, compressed in blocks of 32 steps (consecutive frames
  differ in a few pixels), and never a stacked copy;
* every sampled window holds the stacked observation ``[4, 84, 84]`` per record, as
  ``FrameStackObservation(env, 4)`` would have returned it, rebuilt when it is gathered;
* the stack of the next observation is the next record's: nothing is stored twice.

At the end the open episodes are stored as truncated (``writer.close()``), the buffer's
``memory_report()`` is printed, and ``iterate(prefetch=2)`` draws batches of windows
(``burn_in`` 40 + length 64 + bootstrap 5 records, as R2D2) for a few seconds: its rate is
what a learner could consume. This example collects and samples only; it does not learn
(an Atari agent needs millions of steps and an accelerator, not a CPU minute).

Needs ``pip install "lucid-replay[compress]" gymnasium ale-py`` (ale-py ships the ROMs).
Run ``python examples/atari_pixels.py --help`` for the settings.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from lucid_replay import EpisodeWriter, Field, SequenceReplay, Window


def make_envs(game: str, num_envs: int):  # type: ignore[no-untyped-def]  # gymnasium is untyped
    """``num_envs`` preprocessed Atari environments in one synchronous vector env."""
    import ale_py
    import gymnasium as gym
    from gymnasium.wrappers import AtariPreprocessing

    gym.register_envs(ale_py)

    def make():  # type: ignore[no-untyped-def]
        env = gym.make(f"ALE/{game}-v5", frameskip=1)
        return AtariPreprocessing(env, frame_skip=4, screen_size=84, grayscale_obs=True)

    return gym.vector.SyncVectorEnv([make for _ in range(num_envs)])


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--game", default="Pong", help="an ALE game (default Pong)")
    add("--steps", type=int, default=2000, help="environment steps in all (default 2000)")
    add("--num-envs", type=int, default=4)
    add("--capacity", type=int, default=100_000, help="buffer capacity in records")
    add("--batch-size", type=int, default=32, help="windows per batch (default 32)")
    add("--batches", type=int, default=20, help="batches timed from iterate (default 20)")
    add("--codec", choices=("zstd", "lz4", "none"), default="zstd")
    add("--seed", type=int, default=0)
    return parser.parse_args()


def main() -> None:
    args = parse()
    codec = None if args.codec == "none" else args.codec
    schema = {
        # REPLAY: one frame stored per step, compressed; batches hold [4, 84, 84] stacks
        "observation": Field((84, 84), torch.uint8, stack=4, codec=codec),
        "action": ((), torch.int64),
        "reward": ((), torch.float32),  # gymnasium's float64 rewards are cast on add
    }
    buffer = SequenceReplay(args.capacity, schema=schema, seed=args.seed)
    envs = make_envs(args.game, args.num_envs)
    envs.action_space.seed(args.seed)
    began = time.perf_counter()
    with EpisodeWriter(buffer, args.num_envs) as writer:  # REPLAY: stream -> whole episodes
        observation, _ = envs.reset(seed=args.seed)
        writer.reset(observation)
        for _ in range(max(args.steps // args.num_envs, 1)):
            action = envs.action_space.sample()
            observation, reward, terminated, truncated, _ = envs.step(action)
            writer.step(action, reward, terminated, truncated, observation)
    # leaving the block stored the open episodes as truncated
    envs.close()
    collected = time.perf_counter() - began
    print(f"collected {len(buffer)} records in {buffer.num_episodes} episodes ({collected:.1f} s)")

    report = buffer.memory_report()["fields"]["observation"]
    raw, stored = report["raw_bytes"], report["stored_bytes"]
    per_step = stored / max(len(buffer), 1)
    print(
        f"observation: {raw / 1e6:.1f} MB of frames stored in {stored / 1e6:.2f} MB "
        f"({raw / max(stored, 1):.1f}x smaller, {per_step:,.0f} B per step; a stacked "
        f"[4, 84, 84] observation is 28,224 B)"
    )

    window = Window(64, burn_in=40, bootstrap=5)
    if buffer.num_eligible(window) == 0:
        window = Window(8, burn_in=4, bootstrap=1)  # tiny runs: episodes shorter than 109
    iterator = buffer.iterate(args.batch_size, window, prefetch=2)
    batch = next(iterator)  # warm-up: the first batch also allocates
    print(f"batch observation: {tuple(batch['observation'].shape)} {batch['observation'].dtype}")
    began = time.perf_counter()
    for _ in range(args.batches):
        batch = next(iterator)
    elapsed = time.perf_counter() - began
    iterator.close()  # type: ignore[attr-defined]  # a generator
    rate = args.batches / elapsed
    sizes = np.asarray(batch["observation"].shape[:2]).prod()
    print(
        f"iterate(prefetch=2): {rate:.1f} batches/s, {rate * args.batch_size:,.0f} windows/s "
        f"({rate * sizes:,.0f} stacked observations/s)"
    )


if __name__ == "__main__":
    main()
