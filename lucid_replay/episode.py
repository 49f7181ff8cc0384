"""`Episode`: one whole episode as named per-step tensors sharing a leading time dimension."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import torch

from lucid_replay.errors import InvalidArgumentError, SchemaDtypeError, wrong_type
from lucid_replay.schema import Schema

if TYPE_CHECKING:
    from tensordict import TensorDictBase  # type: ignore[import-untyped]  # no py.typed

__all__ = ["Episode"]


def _field_tensor(name: str, value: Any) -> torch.Tensor:
    """Convert one field to a tensor, sharing memory with numpy input where possible."""
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided or value.is_meta or value.is_quantized or value.is_nested:
            kind = "meta" if value.is_meta else str(value.layout).removeprefix("torch.")
            raise SchemaDtypeError(
                f"steps[{name!r}] must be a dense tensor with data (strided, not meta, sparse, "
                f"quantized or nested), got a {kind} tensor"
            )
        return value
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "biufc":
            raise SchemaDtypeError(
                f"steps[{name!r}] must be numeric or bool, got a numpy array of dtype {value.dtype}"
            )
        # from_numpy refuses negative strides and warns on read-only memory: copy only then.
        shareable = value.flags.writeable and (not value.strides or min(value.strides) >= 0)
        return torch.from_numpy(value if shareable else value.copy())
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise SchemaDtypeError(
            f"steps[{name!r}] must be a tensor, numpy array or sequence, got {type(value).__name__}"
        )
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as error:
        raise SchemaDtypeError(
            f"steps[{name!r}] must be array-like, got {type(value).__name__}: {error}"
        ) from None


def _items(steps: Any) -> list[tuple[Any, Any]]:
    """The (name, value) pairs of any mapping, TensorDicts included.

    A `Mapping`, or an object with ``keys`` and ``__getitem__`` such as a TensorDict, whose
    truth value and ``items`` mean something else.
    """
    if isinstance(steps, Mapping):
        return list(steps.items())
    if isinstance(steps, str | bytes) or not (
        hasattr(steps, "keys") and hasattr(steps, "__getitem__")
    ):
        raise SchemaDtypeError(
            f"steps must be a mapping of field names, got {type(steps).__name__}"
        )
    return [(name, steps[name]) for name in steps.keys()]  # noqa: SIM118 - not a Mapping


def _to_tensor_steps(steps: Any) -> Mapping[str, torch.Tensor]:
    items = _items(steps)
    if not items:
        raise InvalidArgumentError("steps must hold at least one field, got an empty mapping")
    tensors: dict[str, torch.Tensor] = {}
    for name, value in items:
        if not isinstance(name, str):
            raise SchemaDtypeError(f"field names must be str, got {name!r}")
        tensor = _field_tensor(name, value)
        if tensor.dim() == 0:
            raise InvalidArgumentError(
                f"steps[{name!r}] must have a leading time dimension, got a 0-d value"
            )
        tensors[name] = tensor
    lengths = {name: int(t.shape[0]) for name, t in tensors.items()}
    if len(set(lengths.values())) > 1:
        raise InvalidArgumentError(
            f"every field must share one leading length T, got lengths {lengths}"
        )
    if next(iter(lengths.values())) == 0:
        raise InvalidArgumentError(f"episode length T must be >= 1, got lengths {lengths}")
    return MappingProxyType(tensors)


def _numpy_views(steps: Mapping[str, torch.Tensor]) -> Mapping[str, np.ndarray] | None:
    """Arrays sharing each field's memory, or None if a field has none.

    A tensor has no numpy view when it is not on CPU, requires grad, or has a dtype numpy lacks.
    """
    try:
        return MappingProxyType({name: t.numpy() for name, t in steps.items()})
    except (TypeError, RuntimeError):
        return None


def _as_flag(value: object) -> bool:
    """Accept Python and numpy booleans (as environments return them); refuse anything else."""
    if not isinstance(value, bool | np.bool_):
        raise wrong_type("terminated", "a bool", value)
    return bool(value)


@attrs.frozen(eq=False)
class Episode:
    """One whole episode: named per-step tensors that share one leading time dimension ``T``.

    Parameters
    ----------
    steps
        Field name -> per-step values of shape ``[T, *field_shape]``: torch tensors, numpy arrays
        (wrapped without a copy where possible) or nested sequences. ``T >= 1``. Any mapping
        is accepted, a TensorDict of flat entries included.
    terminated
        ``True`` when the last step reached a terminal state (nothing to bootstrap from);
        ``False`` when the episode was truncated or the rollout simply stopped.

    Attributes
    ----------
    schema
        Field name -> ``(per-step shape, dtype)``, in the form of a buffer's ``schema``.

    Raises
    ------
    InvalidArgumentError
        (a ``ValueError``) for an empty mapping, ``T == 0``, fields of different leading
        lengths, or a 0-d value.
    SchemaDtypeError
        (a ``TypeError``) for a value that is not array-like, or a tensor without dense data
        (sparse, ``meta``, quantized or nested), which could not be copied into storage.

    Notes
    -----
    The episode is frozen: fields cannot be re-bound. The tensors are the caller's (no copy is
    made here); a buffer copies them when the episode is added, so mutating their values
    afterwards never changes stored data. Their shapes are read once, here: do not resize them
    in place. An episode pickles, for example through a multiprocessing queue from an actor
    process, as its steps and ``terminated``.

    Examples
    --------
    >>> import torch
    >>> steps = {"obs": torch.zeros(3, 4), "reward": [1.0, 0.0, 2.0]}
    >>> episode = Episode(steps, terminated=True)
    >>> len(episode), episode["obs"].shape, episode["reward"].dtype
    (3, torch.Size([3, 4]), torch.float32)
    """

    steps: Mapping[str, torch.Tensor] = attrs.field(converter=_to_tensor_steps)
    terminated: bool = attrs.field(default=False, kw_only=True, converter=_as_flag)
    schema: Schema = attrs.field(init=False, repr=False)
    _length: int = attrs.field(init=False, repr=False)
    # numpy views of the steps when every field has one (CPU, no autograd, a numpy dtype):
    # a buffer on CPU copies through them at a fifth of the per-call cost of `Tensor.copy_`.
    _host_steps: Mapping[str, np.ndarray] | None = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "schema", Schema.of(self.steps))
        object.__setattr__(self, "_length", int(next(iter(self.steps.values())).shape[0]))
        object.__setattr__(self, "_host_steps", _numpy_views(self.steps))

    @classmethod
    def from_transitions(
        cls, transitions: Sequence[Mapping[str, Any]], *, terminated: bool = False
    ) -> Episode:
        """Build an episode from a list of per-step mappings (one dict per step).

        Examples
        --------
        >>> Episode.from_transitions([{"x": 1.0}, {"x": 2.0}])["x"]
        tensor([1., 2.])
        """
        if not transitions:
            raise InvalidArgumentError("transitions must hold at least one step, got []")
        names = list(transitions[0])
        for index, step in enumerate(transitions):
            if list(step) != names:
                raise InvalidArgumentError(
                    f"transitions[{index}] must have fields {names}, got {list(step)}"
                )
        stacked = {
            name: torch.stack([torch.as_tensor(step[name]) for step in transitions])
            for name in names
        }
        return cls(stacked, terminated=terminated)

    @classmethod
    def from_tensordict(cls, td: TensorDictBase, *, terminated: bool | None = None) -> Episode:
        """An episode of a TorchRL trajectory: a TensorDict with batch dims ``[T]``.

        Nested keys become ``"."``-joined names (``("next", "obs")`` -> ``"next.obs"``);
        ``terminated`` defaults to ``("next", "terminated")`` at the last step. Rules and
        refusals: the TensorDict interop reference page.
        """
        from lucid_replay.tensordict import trajectory_steps

        steps, flag = trajectory_steps(td, terminated=terminated)
        return cls(steps, terminated=flag)

    def __reduce__(self) -> tuple[Any, tuple[dict[str, torch.Tensor], bool]]:
        # Pickled (copied, sent through a multiprocessing queue) as its steps and flag only:
        # the schema and numpy views are rebuilt on load, over the unpickled tensors.
        return _rebuild, (dict(self.steps), self.terminated)

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.steps[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.steps)

    def keys(self) -> Iterator[str]:
        """Field names, in insertion order."""
        return iter(self.steps)

    def __repr__(self) -> str:
        fields = ", ".join(
            f"{name}: {tuple(t.shape[1:])} {str(t.dtype).removeprefix('torch.')}"
            for name, t in self.steps.items()
        )
        return f"Episode(T={len(self)}, terminated={self.terminated}, {{{fields}}})"


def host_views(episode: Episode) -> Mapping[str, np.ndarray] | None:
    """Numpy views of ``episode``'s steps (the same memory), or None if a field has none.

    What a buffer on CPU copies through, at a fifth of the per-call cost of `Tensor.copy_`.
    """
    return episode._host_steps


def _rebuild(steps: dict[str, torch.Tensor], terminated: bool) -> Episode:
    """Unpickle an `Episode`."""
    return Episode(steps, terminated=terminated)
