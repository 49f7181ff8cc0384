"""TensorDict interop (optional extra ``tensordict``): TorchRL trajectories in, batches out.

TorchRL keeps what a step led to under the ``"next"`` sub-dict (``("next", "obs")``,
``("next", "reward")``, ``("next", "done")``); an `Episode` has flat field names. The two meet
through one rule: a nested key is the field name of its parts joined with ``"."``
(``("next", "obs")`` <-> ``"next.obs"``), at any depth. Key parts that already contain a ``"."``
and empty key parts are refused, so the mapping is one-to-one both ways.

`trajectory_steps` backs `Episode.from_tensordict` and `batch_tensordict` backs
``to_tensordict()`` on every batch (`TrajectoryAssembler`, in ``assembler``, builds on the
first). This module knows neither class: they call it with their entries. ``tensordict``
itself is imported only when one of them is called.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from lucid_replay.errors import InvalidArgumentError, must, wrong_kind, wrong_type

if TYPE_CHECKING:
    # tensordict ships no type information (no py.typed): its names are Any to mypy.
    from tensordict import TensorDictBase  # type: ignore[import-untyped]

__all__: list[str] = []  # helpers behind Episode and the batches; nothing public here

NestedKey = str | tuple[str, ...]
_DONE_FLAGS = (("next", "done"), ("next", "terminated"), ("next", "truncated"))


def require_tensordict() -> Any:
    """The ``tensordict`` module, or an ``ImportError`` that says how to install it."""
    try:
        import tensordict  # mypy reports the missing py.typed once, at the import above
    except ImportError as error:
        raise ImportError(
            "TensorDict interop needs the tensordict package: pip install lucid-replay[tensordict]"
        ) from error
    return tensordict


def check_tensordict(name: str, td: object) -> Any:
    """The ``tensordict`` module, once ``td`` (argument ``name``) is a TensorDict."""
    module = require_tensordict()
    if not isinstance(td, module.TensorDictBase):
        raise wrong_kind(name, "a TensorDict", type(td).__name__)
    return module


def _parts(key: NestedKey) -> tuple[str, ...]:
    return (key,) if isinstance(key, str) else tuple(key)


# ------------------------------------------------------------------------------ episodes


def trajectory_steps(
    td: TensorDictBase, *, terminated: bool | None = None
) -> tuple[dict[str, torch.Tensor], bool]:
    """The steps and ``terminated`` flag of a TorchRL trajectory (`Episode.from_tensordict`)."""
    module = check_tensordict("td", td)
    if td.batch_dims != 1:
        raise must("td", "a trajectory with one batch dimension (time)", list(td.batch_size))
    length = int(td.batch_size[0])
    if length == 0:
        raise must("td", "a trajectory of at least one step", list(td.batch_size))
    steps: dict[str, torch.Tensor] = {}
    leaves = td.items(include_nested=True, leaves_only=True, is_leaf=module.is_leaf_nontensor)
    for key, value in leaves:
        parts = _parts(key)
        if not isinstance(value, torch.Tensor):
            raise wrong_kind(f"td[{key!r}]", "a tensor", type(value).__name__)
        if any("." in part for part in parts):
            raise must(f"td key {key!r}", "free of '.' (it joins nested keys)", key)
        if not all(parts):
            raise must(
                f"td key {key!r}",
                "made of non-empty parts (joined by '.' into the field name)",
                key,
            )
        steps[".".join(parts)] = value
    if not steps:
        raise must("td", "a trajectory with at least one tensor entry", list(td.keys()))
    flags = {key: _last_and_early(td, key, length) for key in _DONE_FLAGS if key in td.keys(True)}
    for key, (_, early) in flags.items():
        if early is not None:
            raise InvalidArgumentError(
                f"td[{key!r}] must be False before the last step (one episode per call), "
                f"got {early}"
            )
    return steps, _terminated(flags, terminated)


def _last_and_early(td: TensorDictBase, key: tuple[str, str], length: int) -> tuple[bool, Any]:
    """Whether flag ``key`` is set at the last step, and the first earlier step it is set at."""
    flag = td.get(key)
    if not isinstance(flag, torch.Tensor) or flag.dtype != torch.bool:
        raise wrong_kind(f"td[{key!r}]", "a bool tensor", str(getattr(flag, "dtype", flag)))
    per_step = flag.reshape(length, -1).any(dim=1)
    early = per_step[:-1].nonzero()
    first = f"True at step {int(early[0])} of {length}" if early.numel() else None
    return bool(per_step[-1]), first


def _terminated(flags: dict[tuple[str, str], tuple[bool, Any]], given: object) -> bool:
    if given is not None and not isinstance(given, bool | np.bool_):
        raise wrong_type("terminated", "a bool or None", given)
    stored = flags.get(("next", "terminated"))
    if given is not None:
        if stored is not None and stored[0] != bool(given):
            raise must("terminated", "td[('next', 'terminated')] at the last step", given)
        return bool(given)
    if stored is not None:
        return stored[0]
    done = flags.get(("next", "done"))
    if done is not None and not done[0]:
        return False  # not done, so not terminated either
    ended = " and is done at its last step" if done is not None else ""
    raise must("terminated", f"a bool when td has no ('next', 'terminated') entry{ended}", None)


# ------------------------------------------------------------------------------- batches


def batch_tensordict(
    data: Mapping[str, torch.Tensor],
    per_record: Mapping[str, torch.Tensor],
    per_row: Mapping[str, torch.Tensor],
    shape: tuple[int, int],
    device: torch.device,
) -> TensorDictBase:
    """A TensorDict of batch dims ``shape`` (see ``Batch.to_tensordict``).

    ``data`` fields nest back at their ``"."``; ``per_record`` entries (``shape`` each) keep
    their names; ``per_row`` entries (``[B]``) are repeated along the records as views.
    """
    module = require_tensordict()
    entries: dict[tuple[str, ...], torch.Tensor] = {}
    for name, value in data.items():
        parts = tuple(name.split("."))
        if not all(parts):
            raise must(f"batch field {name!r}", "made of non-empty parts between '.'", name)
        entries[parts] = value
    added = {**per_record, **{name: v[:, None].expand(shape) for name, v in per_row.items()}}
    for name, value in added.items():
        if (name,) in entries:
            raise must(
                f"batch field {name!r}", f"named unlike the entries added ({sorted(added)})", name
            )
        entries[(name,)] = value
    _check_nesting(entries)
    return module.TensorDict(entries, batch_size=shape, device=device)


def _check_nesting(entries: Iterable[tuple[str, ...]]) -> None:
    """Refuse a key that is also the sub-dict of another (``"next"`` and ``"next.obs"``)."""
    keys = set(entries)
    for key in keys:
        for end in range(1, len(key)):
            if key[:end] in keys:
                parent, child = ".".join(key[:end]), ".".join(key)
                raise must(
                    f"batch field {parent!r}", f"a leaf, not the sub-dict of {child!r}", parent
                )
