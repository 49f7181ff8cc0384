"""Quick start: store rollouts as whole episodes, sample chunks and windows, update priorities.

The environment is a one-dimensional random walk that ends (terminated) when the walker
reaches +/-5, or is truncated after 40 steps. Run with ``python examples/quickstart.py``.
"""

from __future__ import annotations

import torch

from lucid_replay import Episode, PrioritizedSequenceReplay, Window


def random_walk(generator: torch.Generator, max_steps: int = 40) -> Episode:
    """One rollout of a random policy: observation, action, reward per step."""
    position, observations, actions, rewards = 0, [], [], []
    terminated = False
    for _ in range(max_steps):
        action = int(torch.randint(0, 2, (), generator=generator))
        observations.append([float(position)])
        actions.append(action)
        position += 1 if action else -1
        terminated = abs(position) >= 5
        rewards.append(1.0 if terminated else 0.0)
        if terminated:
            break
    return Episode(
        {
            "obs": torch.tensor(observations),
            "action": torch.tensor(actions),
            "reward": torch.tensor(rewards),
        },
        terminated=terminated,
    )


def main() -> None:
    """Fill a small buffer, then sample chunks and windows the way a learner would."""
    rollouts = torch.Generator().manual_seed(0)
    buffer = PrioritizedSequenceReplay(capacity=500, alpha=0.6, beta=0.4, seed=0)
    for _ in range(40):
        buffer.add(random_walk(rollouts))
    stats = buffer.stats()
    print(
        f"stored {len(buffer)} transitions in {buffer.num_episodes} episodes "
        f"(added {stats['episodes_added']}, evicted {stats['episodes_evicted']})"
    )

    chunks = buffer.sample_prioritized(batch_size=4, length=5)
    print("chunk obs shape:", tuple(chunks["obs"].shape))
    print("chunk episode ids:", chunks.indices.tolist(), "starts:", chunks.starts.tolist())
    print("importance weights:", [round(w, 3) for w in chunks.weights.tolist()])

    # Pretend the learner measured TD errors; priorities follow them.
    applied = buffer.update_priorities(chunks.indices, torch.tensor([2.0, 0.1, 0.5, 1.0]))
    print(f"updated {applied} episode priorities; max priority now {buffer.max_priority:.2f}")

    window = Window(4, burn_in=2, bootstrap=1, boundary="pad")
    batch = buffer.sample_windows(batch_size=2, window=window)
    print("window records per sample:", window.size, "| obs:", tuple(batch["obs"].shape))
    print("learning mask:", batch.learning_mask[0].int().tolist())
    print("validity mask:", batch.validity_mask.int().tolist())
    td_errors = torch.rand(batch.validity_mask.shape)
    buffer.update_priorities_from(batch, td_errors, eta=0.9)
    buffer.anneal_beta(fraction=0.5)
    print(f"beta annealed to {buffer.beta:.2f}")


if __name__ == "__main__":
    main()
