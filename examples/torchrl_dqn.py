"""DQN on CartPole with TorchRL's collector and loss, and lucid_replay as the replay.

TorchRL collects; a ``TrajectoryAssembler`` turns its batches (cut at arbitrary steps, one
trajectory id per episode) into whole episodes in a ``PrioritizedSequenceReplay``; sampled
one-step chunks come back as TensorDicts in TorchRL's layout (``("next", ...)`` keys,
``priority_weight``), so TorchRL's ``DQNLoss`` trains on them as it would on its own buffer,
and the ``td_error`` it writes goes back as episode priorities.

Run ``python examples/torchrl_dqn.py --help`` for the settings (a few minutes on a CPU).
"""

from __future__ import annotations

import argparse
import warnings
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import nn

with warnings.catch_warnings():  # TorchRL 0.14 warns about its own renamed collector
    warnings.simplefilter("ignore", DeprecationWarning)
    from torchrl.collectors import Collector
from tensordict.nn import TensorDictSequential
from torchrl.envs import GymEnv, StepCounter, TransformedEnv
from torchrl.modules import MLP, EGreedyModule, QValueActor
from torchrl.objectives import DQNLoss, SoftUpdate

from lucid_replay import PrioritizedSequenceReplay, TrajectoryAssembler


def setting(default: Any, help: str) -> Any:
    """A dataclass field whose help text doubles as the ``--help`` line."""
    return field(default=default, metadata={"help": help})


@dataclass
class Args:
    seed: int = setting(0, "seed for torch, the environments and the replay")
    frames: int = setting(40_000, "environment steps to collect")
    frames_per_batch: int = setting(100, "steps per collector batch")
    batch_size: int = setting(128, "one-step chunks per update")
    updates_per_batch: int = setting(25, "gradient steps per collector batch")
    learning_starts: int = setting(1_000, "stored steps before the first update")
    eval_episodes: int = setting(5, "greedy episodes for the final evaluation")


def parse_args() -> Args:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for f in fields(Args):
        flag = "--" + f.name.replace("_", "-")
        parser.add_argument(flag, type=type(f.default), default=f.default, help=f.metadata["help"])
    return Args(**vars(parser.parse_args()))


def make_env(seed: int) -> TransformedEnv:
    env = TransformedEnv(GymEnv("CartPole-v1"), StepCounter())
    env.set_seed(seed)
    return env


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    env = make_env(args.seed)
    actions = env.action_spec.shape[-1]
    value_net = MLP(out_features=actions, num_cells=[128, 128], activation_class=nn.ReLU)
    actor = QValueActor(value_net, in_keys=["observation"], spec=env.action_spec)
    actor(env.reset())  # materialise the lazy layers
    explore = EGreedyModule(
        env.action_spec, eps_init=1.0, eps_end=0.05, annealing_num_steps=args.frames // 2
    )
    policy = TensorDictSequential(actor, explore)
    loss = DQNLoss(actor, action_space=env.action_spec, delay_value=True)
    loss.make_value_estimator(gamma=0.99)
    target_update = SoftUpdate(loss, eps=0.995)
    optimizer = torch.optim.Adam(loss.parameters(), lr=1e-3)

    # REPLAY: whole episodes, drawn by priority; the collector's batches are cut anywhere.
    buffer = PrioritizedSequenceReplay(100_000, alpha=0.6, beta=0.4, seed=args.seed)
    assembler = TrajectoryAssembler(buffer)
    collector = Collector(
        env, policy, frames_per_batch=args.frames_per_batch, total_frames=args.frames
    )
    returns: list[float] = []
    for iteration, collected in enumerate(collector):
        explore.step(collected.numel())
        assembler.extend(collected)  # REPLAY: stores the episodes that ended in this batch
        ended = collected["next", "done"].squeeze(-1)
        returns += collected["next", "step_count"][ended].squeeze(-1).float().tolist()
        if len(buffer) < args.learning_starts:
            continue
        buffer.anneal_beta(min(1.0, iteration * args.frames_per_batch / args.frames))
        for _ in range(args.updates_per_batch):
            # REPLAY: one-step chunks as a TensorDict of TorchRL's keys, weights included
            batch = buffer.sample_prioritized(args.batch_size, 1)
            data = batch.to_tensordict().reshape(-1)
            loss_td = loss(data)
            optimizer.zero_grad()
            loss_td["loss"].backward()
            optimizer.step()
            target_update.step()
            # REPLAY: DQNLoss wrote |TD error| per transition: one priority per episode
            buffer.update_priorities(batch.indices, data["td_error"].detach().reshape(-1))
        collector.update_policy_weights_()
        if iteration % 50 == 0 and returns:
            recent = returns[-20:]
            frames = (iteration + 1) * args.frames_per_batch
            print(f"frames {frames}: mean return of the last 20 episodes {sum(recent) / 20:.1f}")
    collector.shutdown()

    with torch.no_grad():
        evaluation = [
            float(make_env(args.seed + 1000 + i).rollout(500, actor)["next", "reward"].sum())
            for i in range(args.eval_episodes)
        ]
    print(f"stored {buffer.stats()['episodes_added']} episodes")
    print(f"final evaluation return: {sum(evaluation) / len(evaluation):.1f}")


if __name__ == "__main__":
    main()
