"""`n_step_returns`: n-step targets over the records of a `WindowBatch`."""

from __future__ import annotations

from typing import Literal

import torch

from lucid_replay.batch import WindowBatch
from lucid_replay.checks import check_float, check_int
from lucid_replay.errors import must, wrong_kind

__all__ = ["n_step_returns"]

_VALUES_OF = ("record", "next")


def n_step_returns(
    batch: WindowBatch,
    rewards: torch.Tensor,
    bootstrap_values: torch.Tensor,
    *,
    n: int,
    discount: float,
    values_of: Literal["record", "next"] = "record",
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""n-step targets for the learning records of ``batch``, and which records own one.

    Record ``k`` *links* to record ``k + 1`` when that is its episode's next step: valid, of
    the same episode, one step later. ``rewards[:, k]`` is the reward of the transition out
    of record ``k``. From each record, transitions are followed while the records link, up
    to ``n`` of them; with $m_k \le n$ followed, the target bootstraps from the value
    reached, unless that is the last step of a terminated episode (``batch.terminal``; its
    value counts as zero):

    $$
    y_k = \sum_{i=0}^{m_k - 1} \gamma^{i}\, r_{k+i}
          + \gamma^{m_k}\, [\neg\,\text{terminal}_{j}]\; V_{j},
    $$

    where the value reached depends on what ``bootstrap_values`` holds (``values_of``):

    * ``"record"`` (the default): ``V[:, k]`` is the value of record ``k``'s own
      observation. Episodes store the final observation as one extra record (action and
      reward 0, as the recurrent Q-learning guide shows), so a transition out of ``k``
      exists iff ``k`` links to ``k + 1``, and $j = k + m_k$. The extra final record owns
      no transition.
    * ``"next"``: ``V[:, k]`` is the value of the observation record ``k``'s step led to,
      TorchRL's layout (``("next", "obs")``, as `Episode.from_tensordict` stores it). Every
      valid record owns its transition, the next ones follow while records link, and
      $j = k + m_k - 1$.

    Parameters
    ----------
    batch
        A `WindowBatch` drawn with ``dilation=1``. Give its window ``bootstrap >= n``
        records (``n - 1`` under ``"next"``): records past the window's end are never
        reached, so the last learning records would otherwise get shorter returns.
    rewards
        Float ``[B, W]``: ``rewards[:, k]`` is received on the transition out of record
        ``k`` (``batch["reward"]``, or ``batch["next.reward"].squeeze(-1)``). Entries of
        records without a transition are never read.
    bootstrap_values
        Float ``[B, W]``, for example the target network's
        ``Q(s, argmax_a Q_online(s, a))`` at each record's observation (``"record"``) or
        next observation (``"next"``). Only the entries bootstrapped from are read, so NaN
        or inf elsewhere never reaches a target; nor does a value whose discount
        $\gamma^{m_k}$ is 0 (``discount=0`` gives the rewards alone).
    n
        The most transitions summed per target. ``>= 1``.
    discount
        $\gamma$, in ``[0, 1]``.
    values_of
        ``"record"`` or ``"next"``, as above.

    Returns
    -------
    targets
        ``[B, W]``, in the dtype ``rewards`` and ``bootstrap_values`` promote to: ``y_k``
        where ``mask`` is set, 0 elsewhere.
    mask
        Bool ``[B, W]``: a learning, valid record that owns a transition. Use it for the
        loss and as ``mask=`` of `PrioritizedSequenceReplay.update_priorities_from`.

    Raises
    ------
    TypeError
        If ``batch`` is not a `WindowBatch`, a value is not a floating-point tensor, or
        ``n`` or ``discount`` is not a number.
    InvalidArgumentError
        (a ``ValueError``) for a shape other than ``[B, W]``, another device than the
        batch's, ``n < 1``, ``discount`` outside ``[0, 1]``, an unknown ``values_of``, or a
        batch drawn with ``dilation > 1`` (records ``dilation`` steps apart: the rewards
        between them are not in the batch).

    Notes
    -----
    Records of a neighbouring episode (``boundary="include_reset"``) never enter a return,
    nor do padded records (``"pad"``, ``"stop"``): no record links to them. Cost O(n B W),
    one vectorised pass per step.

    Examples
    --------
    >>> import torch
    >>> from lucid_replay import Episode, SequenceReplay, Window
    >>> buffer = SequenceReplay(capacity=100)
    >>> # 3 environment steps and the final observation; the episode terminated.
    >>> _ = buffer.add(Episode({"reward": [1.0, 2.0, 4.0, 0.0]}, terminated=True))
    >>> batch = buffer.gather_windows([0, 0], [0, 2], Window(2, bootstrap=2))
    >>> values = torch.full((2, 4), 10.0)
    >>> rewards = batch["reward"]
    >>> targets, mask = n_step_returns(batch, rewards, values, n=2, discount=0.5)
    >>> targets  # 1 + 0.5 * 2 + 0.25 * 10, then 2 + 0.5 * 4 + 0.25 * 0 (terminal)
    tensor([[4.5000, 4.0000, 0.0000, 0.0000],
            [4.0000, 0.0000, 0.0000, 0.0000]])
    >>> mask  # the final observation (step 3) owns no transition
    tensor([[ True,  True, False, False],
            [ True, False, False, False]])
    """
    if not isinstance(batch, WindowBatch):
        raise wrong_kind("batch", "a WindowBatch", type(batch).__name__)
    n = check_int("n", n, minimum=1)
    discount = check_float("discount", discount, minimum=0.0)
    if discount > 1:
        raise must("discount", "in [0, 1]", discount)
    shape, device = tuple(batch.validity_mask.shape), batch.validity_mask.device
    for name, value in (("rewards", rewards), ("bootstrap_values", bootstrap_values)):
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            what = getattr(value, "dtype", type(value).__name__)
            raise wrong_kind(name, "a floating-point tensor", str(what))
        if tuple(value.shape) != shape:
            raise must(name, f"of the batch's shape {list(shape)}", list(value.shape))
        if value.device != device:
            raise must(name, f"on the batch's device ({device})", str(value.device))
    if values_of not in _VALUES_OF:
        raise must("values_of", f"one of {_VALUES_OF}", values_of)
    width, dtype = shape[1], torch.promote_types(rewards.dtype, bootstrap_values.dtype)
    # Transition j >= 1 (out of record k + j) continues the chain iff record k + j - 1 links
    # to record k + j; under "record", transition 0 too needs record k + 1 (its value).
    if values_of == "record":
        alive, lag = torch.ones(shape, dtype=torch.bool, device=device), 0
    else:
        alive, lag = batch.validity_mask.clone(), 1  # every valid record owns a transition
    if n > lag:
        linked = _shifted(_transitions(batch), 0, False, width)  # record k -> k + 1
    returns = torch.zeros(shape, dtype=dtype, device=device)
    reached = torch.zeros(shape, dtype=torch.int64, device=device)
    zero = torch.zeros((), dtype=dtype, device=device)
    for j in range(min(n, width)):
        if j >= lag:
            alive &= _shifted(linked, j - lag, False, width)
        returns += torch.where(alive, discount**j * _shifted(rewards, j, 0.0, width), zero)
        reached += alive
    # The record bootstrapped from: k + m under "record", the next of record k + m - 1 else.
    last = (torch.arange(width, device=device) + reached - lag).clamp(0, width - 1)
    value = bootstrap_values.gather(1, last).to(dtype)
    value = torch.where(batch.terminal.gather(1, last), zero, value)
    mask = batch.learning_mask & batch.validity_mask & (reached > 0)
    scale = torch.full(shape, discount, dtype=dtype, device=device).pow(reached)
    # A value discounted to nothing (discount 0, or gamma^m below the dtype's range) is not
    # part of the target, whatever it holds: 0 * inf would make the reward NaN.
    bootstrapped = torch.where(scale != 0, scale * value, zero)
    return torch.where(mask, returns + bootstrapped, zero), mask


def _shifted(values: torch.Tensor, by: int, fill: float | bool, width: int) -> torch.Tensor:
    """``[B, width]``: ``values[:, k + by]`` where that exists, ``fill`` after."""
    out = torch.full((values.shape[0], width), fill, dtype=values.dtype, device=values.device)
    kept = max(0, min(width - by, values.shape[1] - by))
    out[:, :kept] = values[:, by : by + kept]
    return out


def _transitions(batch: WindowBatch) -> torch.Tensor:
    """Bool ``[B, W - 1]``: record ``k + 1`` is the next step of record ``k``'s episode."""
    valid, ids, steps = batch.validity_mask, batch.record_episode_ids, batch.record_steps
    both = valid[:, :-1] & valid[:, 1:] & (ids[:, :-1] == ids[:, 1:])
    gaps = steps[:, 1:] - steps[:, :-1]
    if bool((both & (gaps != 1)).any()):
        gap = int(gaps[both & (gaps != 1)][0])
        raise must("batch", "drawn with dilation=1 (its rewards are per step)", f"dilation {gap}")
    return both
