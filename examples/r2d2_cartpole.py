"""R2D2 on partially observable CartPole, with lucid_replay as the replay.

The agent sees only the cart position and the pole angle; the velocities are hidden, so a
feed-forward policy cannot balance the pole and an LSTM has to infer them from history.
The recipe follows R2D2 (Kapturowski et al., 2019), scaled down to run on a laptop CPU:

* an actor steps a gymnasium vector env and an ``EpisodeWriter`` turns its step stream into
  whole episodes: per step the observation, the chosen action, the reward, and as extra
  fields the previous action and the LSTM state (h, c) the actor *entered* that step with;
* each finished episode goes into a ``PrioritizedSequenceReplay`` whole, with
  ``terminated=True`` only when the pole fell (not at the 500-step time limit); with
  ``--segment-length L`` the writer streams every episode instead, committing every ``L``
  records as one segment while the episode is still running;
* the learner samples windows ``[burn-in | learning region | n bootstrap records]``, starts the
  LSTM from the stored state, warms it up over the burn-in without gradients, and regresses
  n-step double-Q targets (``n_step_returns``) computed with a Polyak-averaged target network;
* per-record TD errors become per-episode priorities (``eta * max + (1 - eta) * mean``), the
  importance weights correct for the prioritized draw, and beta is annealed to 1 over training;
* the LSTM states the learner recomputes are written back into the replay, so later windows
  start from fresher stored states;
* every ``eval_interval`` steps the greedy policy plays a few episodes, and the final
  evaluation uses the best weights seen (Q-learning on CartPole peaks, then drifts).

The writer stores each episode with one extra record at the end: the observation the
environment returned after the last action (action, reward and extra fields 0). It is what
truncated episodes bootstrap from; for a terminated episode the replay flags it ``terminal``
and its value counts as zero. The lines that touch the replay are marked ``# REPLAY:``.

Run ``python examples/r2d2_cartpole.py --help`` for the settings.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
import matplotlib

matplotlib.use("Agg")  # headless: the figure only goes to a file
import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from lucid_replay import (
    EpisodeWriter,
    PrioritizedSequenceReplay,
    Window,
    WindowBatch,
    n_step_returns,
)


def setting(default: Any, help: str, kind: type | None = None) -> Any:
    """A dataclass field whose help text doubles as the ``--help`` line.

    ``kind``: the flag's type, where the default (``None``) does not say it.
    """
    return field(default=default, metadata={"help": help, "type": kind or type(default)})


@dataclass
class Args:
    seed: int = setting(0, "seed for torch, numpy, the environments and the replay")
    total_steps: int = setting(60_000, "environment steps to collect, over all environments")
    num_envs: int = setting(8, "environments stepped in lock-step by the actor")
    device: str = setting("cpu", "torch device for the networks and sampled batches")
    threads: int = setting(1, "torch CPU threads (small LSTMs run fastest on one)")
    # Network.
    hidden: int = setting(64, "width of the encoder and of the LSTM")
    # Replay and windows.
    capacity: int = setting(100_000, "replay capacity in stored steps")
    segment_length: int | None = setting(
        None, "stream episodes in segments of this many steps (None: store them whole)", int
    )
    alpha: float = setting(0.4, "priority exponent (R2D2 uses 0.9; early falls then crowd replay)")
    beta: float = setting(0.4, "initial importance-sampling exponent, annealed to 1")
    eta: float = setting(0.9, "episode priority = eta * max|td| + (1 - eta) * mean|td|")
    burn_in: int = setting(8, "records replayed without gradients to warm up the LSTM state")
    learn_length: int = setting(16, "records per window that receive a loss")
    n_step: int = setting(3, "n of the n-step return; also the window's bootstrap records")
    write_back: bool = setting(True, "store the learner's refreshed LSTM states in the replay")
    # Learning.
    batch_size: int = setting(32, "windows per gradient step")
    lr: float = setting(1e-3, "Adam learning rate")
    anneal_lr: bool = setting(True, "decay the learning rate linearly to 0 over training")
    gamma: float = setting(0.99, "discount factor")
    learning_starts: int = setting(
        2_000, "steps collected before the first update (capped at a quarter of total_steps)"
    )
    steps_per_update: int = setting(4, "environment steps collected per gradient step")
    tau: float = setting(0.005, "Polyak rate: target += tau * (online - target) per update")
    adam_eps: float = setting(1e-3, "Adam epsilon (above the usual 1e-8: steadier small steps)")
    max_grad_norm: float = setting(10.0, "gradient norm clip")
    eps_start: float = setting(1.0, "initial epsilon of the epsilon-greedy actor")
    eps_end: float = setting(0.05, "final epsilon")
    eps_fraction: float = setting(0.3, "fraction of total_steps over which epsilon decays")
    # Evaluation and output.
    eval_interval: int = setting(2_500, "steps between greedy checks that keep the best net")
    check_episodes: int = setting(10, "greedy episodes per check during training")
    eval_episodes: int = setting(20, "greedy episodes for the final evaluation")
    plot_path: str = setting("r2d2_cartpole.png", "where to write the learning-curve figure")


def parse_args() -> Args:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for f in dataclasses.fields(Args):
        flag = "--" + f.name.replace("_", "-")
        options: dict[str, Any] = {"default": f.default, "help": f.metadata["help"]}
        # The annotations are strings (postponed evaluation); the default's type is the real one.
        if isinstance(f.default, bool):
            options["action"] = argparse.BooleanOptionalAction
        else:
            options["type"] = f.metadata["type"]
        parser.add_argument(flag, **options)
    return Args(**vars(parser.parse_args()))


# ----------------------------------------------------------------------------- environment


class HideVelocities(gym.ObservationWrapper):
    """Keep cart position and pole angle; drop both velocities so the task needs memory.

    Both are divided by their termination thresholds (2.4 m, 12 degrees): the angle is ~0.2 rad
    at most, and the network has to read velocities from its step-to-step differences.
    """

    KEEP = np.array([0, 2])
    SCALE = np.array([2.4, 12 * 2 * np.pi / 360], dtype=np.float32)

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (len(self.KEEP),), np.float32)

    def observation(self, observation: np.ndarray) -> np.ndarray:
        return (observation[self.KEEP] / self.SCALE).astype(np.float32)


def make_envs(n: int) -> gym.vector.SyncVectorEnv:
    """``n`` partially observable CartPoles, reset automatically on the step after an end."""
    return gym.vector.SyncVectorEnv([lambda: HideVelocities(gym.make("CartPole-v1"))] * n)


# ----------------------------------------------------------------------------- network

State = tuple[torch.Tensor, torch.Tensor]


class RecurrentQNetwork(nn.Module):
    """Encoder, LSTM cell and Q head. Like R2D2, the LSTM also sees the previous action: the
    push direction is what changes the hidden velocities."""

    def __init__(self, obs_dim: int, n_actions: int, hidden: int) -> None:
        super().__init__()
        self.hidden, self.n_actions = hidden, n_actions
        self.encoder = nn.Sequential(nn.Linear(obs_dim + n_actions, hidden), nn.ReLU())
        self.lstm = nn.LSTMCell(hidden, hidden)
        self.head = nn.Sequential(
            nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, n_actions)
        )

    def initial_state(self, batch: int, device: torch.device) -> State:
        zeros = torch.zeros(batch, self.hidden, device=device)
        return zeros, zeros.clone()

    def encode(self, obs: torch.Tensor, prev_action: torch.Tensor) -> torch.Tensor:
        # prev_action -1 (episode start) becomes an all-zero one-hot.
        one_hot = F.one_hot(prev_action + 1, self.n_actions + 1)[..., 1:].to(obs.dtype)
        return self.encoder(torch.cat([obs, one_hot], dim=-1))

    def step(
        self, obs: torch.Tensor, prev_action: torch.Tensor, state: State
    ) -> tuple[torch.Tensor, State]:
        h, c = self.lstm(self.encode(obs, prev_action), state)
        return self.head(h), (h, c)

    def unroll(self, batch: WindowBatch, burn_in: int) -> tuple[torch.Tensor, State]:
        """Q-values ``[B, W, A]`` and the LSTM states entering each record ``[B, W, H]``.

        The state is reset to the stored one wherever ``is_init`` is set: at the first valid
        record (the window may start before its episode) and at episode starts. The first
        ``burn_in`` records run without gradients, as in R2D2.
        """
        stored = batch["h"], batch["c"]
        h, c = stored[0][:, 0], stored[1][:, 0]
        xs = self.encode(batch["observation"], previous_actions(batch))
        outputs, entering_h, entering_c = [], [], []
        for k in range(batch.window_size):
            with torch.set_grad_enabled(torch.is_grad_enabled() and k >= burn_in):
                reset = batch.is_init[:, k, None]
                h = torch.where(reset, stored[0][:, k], h)
                c = torch.where(reset, stored[1][:, k], c)
                entering_h.append(h)
                entering_c.append(c)
                h, c = self.lstm(xs[:, k], (h, c))
                outputs.append(h)
        q = self.head(torch.stack(outputs, dim=1))
        return q, (torch.stack(entering_h, dim=1), torch.stack(entering_c, dim=1))


# ----------------------------------------------------------------------------- acting


def previous_actions(batch: WindowBatch) -> torch.Tensor:
    """The action before each record ``[B, W]``: -1 at an episode's first step.

    Stored as the extra field ``prev_action``, except in the extra final record, whose extra
    fields the writer sets to zero: where the record before is its episode's previous step,
    its action is taken from there instead.
    """
    previous = batch["prev_action"].clone()
    ids, valid = batch.record_episode_ids, batch.validity_mask
    follows = (ids[:, 1:] == ids[:, :-1]) & valid[:, 1:] & valid[:, :-1]
    follows &= batch.record_steps[:, 1:] == batch.record_steps[:, :-1] + 1
    previous[:, 1:] = torch.where(follows, batch["action"][:, :-1], previous[:, 1:])
    return previous


class Actor:
    """Steps a vector env with one batched network call; an `EpisodeWriter` stores episodes."""

    def __init__(self, num_envs: int, net: RecurrentQNetwork, seed: int, buffer: Any) -> None:
        self.envs, self.net = make_envs(num_envs), net
        self.envs.action_space.seed(seed)
        self.device = next(net.parameters()).device
        self.rng = np.random.default_rng(seed)
        self.writer = EpisodeWriter(buffer, num_envs)  # REPLAY: stream -> whole episodes
        self.obs, _ = self.envs.reset(seed=seed)
        self.writer.reset(self.obs)  # REPLAY
        self.prev_action = np.full(num_envs, -1)
        self.state = net.initial_state(num_envs, self.device)
        self.returns = np.zeros(num_envs)
        # next_step autoreset: the step after an episode's end only resets that env
        self.restarting = np.zeros(num_envs, dtype=bool)

    @torch.no_grad()
    def step(self, epsilon: float) -> list[float]:
        """One step in every environment; returns the returns of the episodes that ended."""
        obs = torch.as_tensor(self.obs, device=self.device)
        prev_action = torch.as_tensor(self.prev_action, device=self.device)
        h_in, c_in = (s.cpu().numpy() for s in self.state)
        q, self.state = self.net.step(obs, prev_action, self.state)
        actions = q.argmax(dim=1).cpu().numpy()
        explore = self.rng.random(len(actions)) < epsilon
        actions[explore] = self.rng.integers(0, q.shape[1], explore.sum())
        self.obs, reward, terminated, truncated, _ = self.envs.step(actions)
        # REPLAY: the writer keeps per env what the action was chosen from, and stores an
        # episode (plus its final observation) when an env reports its end
        self.writer.step(
            actions,
            reward.astype(np.float32),
            terminated,
            truncated,
            self.obs,
            prev_action=self.prev_action.copy(),
            h=h_in,
            c=c_in,
        )
        self.returns += reward * ~self.restarting
        ended = terminated | truncated
        finished = self.returns[ended].tolist()
        self.returns[ended] = 0.0
        # An env that just reset starts its episode at the next step: fresh state there.
        self.prev_action = np.where(self.restarting, -1, actions)
        for s in self.state:
            s[torch.as_tensor(self.restarting, device=self.device)] = 0.0
        self.restarting = ended
        return finished


# ----------------------------------------------------------------------------- learning


class Learner:
    """Double-Q learner with a Polyak-averaged target network."""

    def __init__(self, net: RecurrentQNetwork, args: Args) -> None:
        self.net, self.args = net, args
        self.target = copy.deepcopy(net).requires_grad_(False)
        self.optimizer = torch.optim.Adam(net.parameters(), lr=args.lr, eps=args.adam_eps)
        self.updates = 0

    def update(self, buffer: PrioritizedSequenceReplay, window: Window, fraction: float) -> float:
        # REPLAY: windows by priority, with importance weights, gathered onto the device
        batch = buffer.sample_windows(self.args.batch_size, window, device=self.args.device)
        return self.learn(batch, buffer, fraction)

    def learn(self, batch: WindowBatch, buffer: Any, fraction: float) -> float:
        """One gradient step on ``batch``; its priorities and states go back to ``buffer``
        (a replay or a sharded replay client: anything with update_priorities_from and
        write_back)."""
        args = self.args
        if args.anneal_lr:  # Q-learning on CartPole oscillates; a shrinking step settles it
            self.optimizer.param_groups[0]["lr"] = args.lr * (1 - fraction)
        q, entering = self.net.unroll(batch, args.burn_in)
        with torch.no_grad():
            q_target, _ = self.target.unroll(batch, args.burn_in)
            greedy = q.argmax(dim=2, keepdim=True)
            q_next = q_target.gather(2, greedy).squeeze(2)
        # REPLAY: n-step double-Q targets [B, W] and the learning records that own a transition
        targets, mask = n_step_returns(
            batch, batch["reward"], q_next, n=args.n_step, discount=args.gamma
        )
        q_taken = q.gather(2, batch["action"][..., None]).squeeze(2)
        td = torch.where(mask, targets - q_taken, torch.zeros_like(q_taken))
        loss = batch.weights[:, None] * F.smooth_l1_loss(q_taken, targets, reduction="none")
        loss = (loss * mask).sum() / mask.sum().clamp(min=1)

        self.optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(self.net.parameters(), args.max_grad_norm)
        self.optimizer.step()

        # REPLAY: per-record TD errors -> per-episode priorities (R2D2's eta mix)
        buffer.update_priorities_from(batch, td.detach().abs(), eta=args.eta, mask=mask)
        if args.write_back:  # REPLAY: refreshed LSTM states back into storage
            buffer.write_back(batch, "h", entering[0].detach())
            buffer.write_back(batch, "c", entering[1].detach())
        self.updates += 1
        with torch.no_grad():  # a slowly moving target damps Q-learning's oscillations
            for online, target in zip(self.net.parameters(), self.target.parameters(), strict=True):
                target.lerp_(online, args.tau)
        return loss.item()


# ----------------------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate(net: RecurrentQNetwork, episodes: int, seed: int) -> np.ndarray:
    """Greedy returns of ``episodes`` episodes, run side by side (each env's first one)."""
    envs = make_envs(episodes)
    device = next(net.parameters()).device
    obs, _ = envs.reset(seed=seed)
    state = net.initial_state(episodes, device)
    actions = torch.full((episodes,), -1, device=device)
    returns = np.zeros(episodes)
    running = np.ones(episodes, dtype=bool)
    while running.any():
        q, state = net.step(torch.as_tensor(obs, device=device), actions, state)
        actions = q.argmax(dim=1)
        obs, reward, terminated, truncated, _ = envs.step(actions.cpu().numpy())
        returns += reward * running
        running &= ~(terminated | truncated)
    envs.close()
    return returns


def save_figure(
    path: str,
    curve: list[tuple[int, float]],
    checks: list[tuple[int, float]],
    priorities: dict[int, float],
    total_steps: int,
) -> None:
    fig, (ax_curve, ax_prio) = plt.subplots(1, 2, figsize=(11, 4))
    if curve:
        steps, returns = np.array(curve).T
        ax_curve.plot(steps, returns, ".", alpha=0.3, markersize=3, label="episode return")
        smooth = np.convolve(returns, np.ones(20) / 20, mode="valid") if len(returns) >= 20 else []
        ax_curve.plot(steps[len(steps) - len(smooth) :], smooth, label="mean of last 20")
    if checks:
        steps, returns = np.array(checks).T
        ax_curve.plot(steps, returns, "o-", label="greedy check")
    ax_curve.set(xlabel="environment steps", ylabel="return", xlim=(0, total_steps))
    ax_curve.set_title("Training episodes (epsilon-greedy) and greedy checks")
    ax_curve.legend(loc="upper left")
    if priorities:
        ids, values = np.array(sorted(priorities.items())).T
        ax_prio.scatter(ids, values, s=6)
    ax_prio.set(xlabel="episode id (older to newer)", ylabel="priority", yscale="log")
    ax_prio.set_title("Priorities of the stored episodes")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ----------------------------------------------------------------------------- main


def epsilon_at(args: Args, fraction: float) -> float:
    decay = min(fraction / args.eps_fraction, 1.0)
    return args.eps_start + decay * (args.eps_end - args.eps_start)


def make_window(args: Args) -> Window:
    # allow_partial: early episodes are shorter than a window and must be learned from too.
    # "stop" moves a window that overruns its episode back inside it, so no learning region
    # holds only the extra final record (it has no transition, hence no TD error).
    return Window(
        args.learn_length,
        burn_in=args.burn_in,
        bootstrap=args.n_step,
        boundary="stop",
        allow_partial=True,
    )


def train(
    args: Args, net: RecurrentQNetwork, buffer: PrioritizedSequenceReplay
) -> tuple[list[tuple[int, float]], list[tuple[int, float]], int]:
    """Collect ``total_steps`` steps, updating as we go, and leave the best checked weights in
    ``net``. Returns (step, return) per training episode, (step, mean return) per greedy check,
    and the number of updates.

    Q-learning on CartPole tends to peak and then drift, so every ``eval_interval`` steps the
    greedy policy plays ``check_episodes`` episodes and the best weights so far are kept (model
    selection, on episode seeds that the final evaluation never uses).
    """
    actor = Actor(args.num_envs, net, args.seed, buffer)
    learner = Learner(net, args)
    window = make_window(args)
    learning_starts = min(args.learning_starts, args.total_steps // 4)
    iterations = -(-args.total_steps // args.num_envs)
    curve: list[tuple[int, float]] = []
    checks: list[tuple[int, float]] = []
    best_return, best_weights = -np.inf, net.state_dict()
    loss, owed_updates = float("nan"), 0.0
    progress = tqdm(total=iterations * args.num_envs, unit="step", dynamic_ncols=True)
    for iteration in range(iterations):
        step = iteration * args.num_envs
        fraction = step / args.total_steps
        epsilon = epsilon_at(args, fraction)
        for episode_return in actor.step(epsilon):
            curve.append((step, episode_return))
        progress.update(args.num_envs)
        # REPLAY: an open episode's anchors need their bootstrap records committed
        if step < learning_starts or buffer.num_eligible(window) == 0:
            continue
        buffer.anneal_beta(fraction)  # REPLAY: beta -> 1 over training
        owed_updates += args.num_envs / args.steps_per_update
        while owed_updates >= 1:
            loss = learner.update(buffer, window, fraction)
            owed_updates -= 1
        crossed = (step + args.num_envs) // args.eval_interval > step // args.eval_interval
        if crossed or iteration == iterations - 1:  # the final weights are checked too
            check = evaluate(net, args.check_episodes, args.seed + 20_000).mean()
            checks.append((step + args.num_envs, check))
            if check >= best_return:  # ties go to the later, longer-trained weights
                best_return, best_weights = check, copy.deepcopy(net.state_dict())
        if iteration % 20 == 0:
            progress.set_postfix(
                ret=f"{np.mean([r for _, r in curve[-20:]]):.0f}",
                eps=f"{epsilon:.2f}",
                loss=f"{loss:.3f}",
                episodes=buffer.stats()["episodes_added"],
                stored=len(buffer),
                beta=f"{buffer.beta:.2f}",
                best=f"{best_return:.0f}",
                refresh=False,
            )
    progress.close()
    net.load_state_dict(best_weights)
    return curve, checks, learner.updates


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)  # numpy generators and environments get args.seed explicitly
    torch.set_num_threads(args.threads)
    probe = make_envs(1)
    net = RecurrentQNetwork(
        probe.single_observation_space.shape[0], int(probe.single_action_space.n), args.hidden
    ).to(args.device)
    # REPLAY: storage stays on the CPU; sample_windows(device=...) gathers onto args.device.
    # With segment_length the writer streams episodes (windows use "stop", never
    # "include_reset", which a segmented buffer refuses).
    buffer = PrioritizedSequenceReplay(
        args.capacity,
        alpha=args.alpha,
        beta=args.beta,
        seed=args.seed,
        segment_length=args.segment_length,
    )

    start = time.perf_counter()
    curve, checks, updates = train(args, net, buffer)
    train_time = time.perf_counter() - start
    returns = evaluate(net, args.eval_episodes, args.seed + 10_000)
    priorities = dict(zip(buffer.episode_ids, buffer.priorities.tolist(), strict=True))
    save_figure(args.plot_path, curve, checks, priorities, args.total_steps)

    print(
        f"trained on {buffer.stats()['episodes_added']} episodes with {updates} updates"
        f" in {train_time:.0f} s; figure: {args.plot_path}"
    )
    print(
        f"final evaluation return: {returns.mean():.1f} +/- {returns.std():.1f}"
        f" over {args.eval_episodes} episodes"
    )


if __name__ == "__main__":
    main()
