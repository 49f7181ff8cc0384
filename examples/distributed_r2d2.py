"""Distributed R2D2 on partially observable CartPole: Ray collectors, a sharded replay, a learner.

The task, the network and the learning rule are those of ``examples/r2d2_cartpole.py``,
imported from it rather than copied (the one file this example reads beside its own, so that
the two stay one algorithm; read that one first). What changes is the topology, as in R2D2
and Ape-X:

* ``num_collectors`` Ray actors each step their own vector of environments with their own
  copy of the policy, refreshed from the learner every ``sync_every`` steps through a small
  parameter actor, and write every finished episode through an ``EpisodeWriter`` into a
  ``ShardedReplay`` of ``num_shards`` shard actors (the client pickles into the actors);
* the learner samples windows with ``iterate(prefetch=...)``, so the shards draw the next
  batches while it computes, updates priorities and writes refreshed LSTM states back on
  the shards, and anneals beta;
* a ``SampleToInsertRatio`` keeps the learner at ``batch_size / steps_per_update`` windows
  per stored transition, as the single-process example does by construction: collectors
  wait when the learner falls behind, the learner waits when collectors do.

Each stored record holds the observation, the action chosen from it, the reward, the previous
action and the LSTM state entering the step; the final record holds the final observation
(its extra fields are zero). Run ``python examples/distributed_r2d2.py --help`` for the
settings; it ends with the greedy evaluation of the best checked weights.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import r2d2_cartpole as r2d2  # noqa: E402  (the single-process example, beside this file)

from lucid_replay import EpisodeWriter, RateLimiterTimeout  # noqa: E402
from lucid_replay.distributed import SampleToInsertRatio, ShardedReplay  # noqa: E402

setting = r2d2.setting


@dataclass
class Args(r2d2.Args):
    num_envs: int = setting(4, "environments per collector")
    num_collectors: int = setting(2, "collector actors (processes)")
    num_shards: int = setting(2, "replay shards (actors)")
    prefetch: int = setting(2, "sample requests the learner keeps in flight")
    sync_every: int = setting(200, "collector steps between policy refreshes from the learner")
    error_buffer: float = setting(10_000.0, "rate limiter band, in windows")
    ray_cpus: int = setting(2, "CPUs of the local Ray cluster")


def parse_args() -> Args:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for f in dataclasses.fields(Args):
        options: dict[str, Any] = {"default": f.default, "help": f.metadata["help"]}
        if isinstance(f.default, bool):
            options["action"] = argparse.BooleanOptionalAction
        else:
            options["type"] = type(f.default)
        parser.add_argument("--" + f.name.replace("_", "-"), **options)
    return Args(**vars(parser.parse_args()))


# ----------------------------------------------------------------------------- actors


class Parameters:
    """The learner's latest weights, for collectors to pull (a Ray actor)."""

    def __init__(self) -> None:
        self.version, self.state = 0, None

    def publish(self, state: dict[str, torch.Tensor]) -> None:
        self.version, self.state = self.version + 1, state

    def latest(self, version: int) -> tuple[int, dict[str, torch.Tensor] | None]:
        return self.version, (self.state if self.version > version else None)


class Collector:
    """Steps its own environments with its own policy copy; stores episodes in the replay."""

    def __init__(self, replay: ShardedReplay, parameters: Any, args: Args, index: int) -> None:
        torch.set_num_threads(1)
        self.args, self.parameters, self.version = args, parameters, 0
        self.seed = args.seed + 1_000 * (index + 1)
        self.rng = np.random.default_rng(self.seed)
        self.envs = r2d2.make_envs(args.num_envs)
        self.net = r2d2.RecurrentQNetwork(2, 2, args.hidden)
        self.writer = EpisodeWriter(replay, num_envs=args.num_envs)
        self.share = args.total_steps // args.num_collectors

    def _refresh(self) -> None:
        version, state = ray.get(self.parameters.latest.remote(self.version))
        if state is not None:
            self.net.load_state_dict(state)
            self.version = version

    @torch.no_grad()
    def run(self) -> list[tuple[int, float]]:
        """Collect this collector's share of the steps; (its step, return) per episode."""
        n = self.args.num_envs
        obs, _ = self.envs.reset(seed=self.seed)
        self.writer.reset(obs)
        state = self.net.initial_state(n, torch.device("cpu"))
        prev_action = np.full(n, -1)
        resetting = np.zeros(n, dtype=bool)  # the step after an end only resets (next_step)
        returns, running, step = [], np.zeros(n), 0
        while step < self.share:
            if step % self.args.sync_every == 0:
                self._refresh()
            epsilon = r2d2.epsilon_at(self.args, step / self.share)
            h_in, c_in = (s.numpy().copy() for s in state)
            q, state = self.net.step(torch.as_tensor(obs), torch.as_tensor(prev_action), state)
            actions = q.argmax(dim=1).numpy()
            explore = self.rng.random(n) < epsilon
            actions[explore] = self.rng.integers(0, 2, explore.sum())
            obs, reward, terminated, truncated, _ = self.envs.step(actions)
            self.writer.step(
                actions,
                reward.astype(np.float32),
                terminated,
                truncated,
                obs,
                prev_action=prev_action.astype(np.int64),
                h=h_in,
                c=c_in,
            )
            running += reward * ~resetting
            prev_action = np.where(resetting, -1, actions)
            state[0][resetting], state[1][resetting] = 0.0, 0.0
            ended = terminated | truncated
            for i in np.flatnonzero(ended):
                returns.append((step * self.args.num_collectors, float(running[i])))
                running[i] = 0.0
            resetting = ended
            step += n
        return returns


# ----------------------------------------------------------------------------- learning


def start_ray(args: Args) -> None:
    """A private single-node cluster on 127.0.0.1; workers can import r2d2_cartpole."""
    os.environ.update(
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
        RAY_AUTH_MODE="disabled",
        RAY_USAGE_STATS_ENABLED="0",
        PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    )
    ray.init(num_cpus=args.ray_cpus, include_dashboard=False, log_to_driver=False)


def train(args: Args) -> dict[str, Any]:
    """Collect ``total_steps`` steps with the collectors while the learner learns (Ray is
    running); leave the best checked weights in the returned network."""
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    learning_starts = min(args.learning_starts, args.total_steps // 4)
    limiter = SampleToInsertRatio(
        samples_per_insert=args.batch_size / args.steps_per_update,
        min_size=learning_starts,
        error_buffer=args.error_buffer,
    )
    replay = ShardedReplay.create(
        args.num_shards, args.capacity, alpha=args.alpha, beta=args.beta,
        seed=args.seed, rate_limiter=limiter,
    )  # fmt: skip
    net = r2d2.RecurrentQNetwork(2, 2, args.hidden)
    learner = r2d2.Learner(net, args)
    parameters = ray.remote(num_cpus=0)(Parameters).remote()
    parameters.publish.remote(net.state_dict())
    collectors = [
        ray.remote(num_cpus=0)(Collector).remote(replay, parameters, args, k)
        for k in range(args.num_collectors)
    ]
    running = [collector.run.remote() for collector in collectors]
    window = r2d2.make_window(args)
    stream = replay.iterate(args.batch_size, window, prefetch=args.prefetch, timeout=5.0)
    best_return, best_weights = -np.inf, copy.deepcopy(net.state_dict())
    start, steps, next_check, loss = time.perf_counter(), 0, args.eval_interval, float("nan")
    while len(ray.wait(running, num_returns=len(running), timeout=0)[0]) < len(running):
        try:
            batch = next(stream)
        except RateLimiterTimeout:  # the collectors are slow or done: look again
            stream = replay.iterate(args.batch_size, window, prefetch=args.prefetch, timeout=5.0)
            continue
        fraction = min(steps / args.total_steps, 1.0)
        loss = learner.learn(batch, replay, fraction)  # the single-process example's
        if learner.updates % 25 == 0:
            stats = replay.stats()
            steps = stats["transitions_added"] - stats["episodes_added"]  # T + 1 records each
            replay.anneal_beta(fraction)
            parameters.publish.remote(copy.deepcopy(net.state_dict()))
        if steps >= next_check:
            next_check += args.eval_interval
            check = r2d2.evaluate(net, args.check_episodes, args.seed + 20_000).mean()
            if check >= best_return:  # ties go to the later, longer-trained weights
                best_return, best_weights = check, copy.deepcopy(net.state_dict())
            print(
                f"steps {steps:6d}  updates {learner.updates:5d}  loss {loss:.3f}  "
                f"greedy {check:5.1f}  best {best_return:5.1f}  "
                f"{time.perf_counter() - start:4.0f} s",
                flush=True,
            )
    stream.close()
    curve = sorted(point for returns in ray.get(running) for point in returns)
    check = r2d2.evaluate(net, args.check_episodes, args.seed + 20_000).mean()
    if check >= best_return:
        best_weights = copy.deepcopy(net.state_dict())
    net.load_state_dict(best_weights)
    stats = replay.stats()
    replay.close()
    return {
        "net": net,
        "stats": stats,
        "updates": learner.updates,
        "seconds": time.perf_counter() - start,
        "recent": float(np.mean([r for _, r in curve[-20:]])) if curve else float("nan"),
    }


def main() -> None:
    args = parse_args()
    start_ray(args)
    result = train(args)
    ray.shutdown()
    returns = r2d2.evaluate(result["net"], args.eval_episodes, args.seed + 10_000)
    stats = result["stats"]
    print(
        f"trained on {stats['episodes_added']} episodes from {args.num_collectors} collectors"
        f" over {args.num_shards} shards with {result['updates']} updates in "
        f"{result['seconds']:.0f} s; last collector returns {result['recent']:.0f}"
    )
    print(
        f"final evaluation return: {returns.mean():.1f} +/- {returns.std():.1f}"
        f" over {args.eval_episodes} episodes"
    )


if __name__ == "__main__":
    main()
