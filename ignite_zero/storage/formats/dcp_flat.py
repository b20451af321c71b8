"""How DCP names the entries of a nested state: the flat state its default planners save and load.

DCP's own walk (``flatten_state_dict``) asks each container whether it is terminal before it walks it; a state of many
small tensors pays that on every save and load. :func:`flatten` gives the same keys, paths and order by a walk that
looks at each value's type once, and leaves to DCP's walk what it cannot tell as cheaply.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ignite_zero import _compat

__all__ = ["flat_state", "flatten"]


def flat_state(state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, tuple[Any, ...]]]:
    """``state`` flattened as DCP flattens it, by :func:`flatten` or else DCP's own walk.

    Returns:
        The flat state, and each key's path in ``state``.
    """
    return flatten(state) or _compat.dcp_flatten(dict(state))


def flatten(state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, tuple[str | int, ...]]] | None:
    """``state`` flattened as DCP's ``flatten_state_dict`` flattens it for a save or a load (the same keys, paths and
    order), by a walk that looks at each value's type once, where DCP's asks each container whether it is terminal
    before it walks it; ``None`` where the state holds what DCP's own walk should take: a mapping that is not a dict,
    a ``ShardedTensor``, or a key that two paths make.

    A dict is walked, its keys made strings; a list is walked where it holds a tensor, a mapping, or such a list (by
    position), else kept whole, as a tuple and any other value are.

    Returns:
        The flat state, and each key's path in ``state``.
    """
    flat: dict[str, Any] = {}
    paths: dict[str, tuple[str | int, ...]] = {}
    if not all(_visit((str(key),), str(key), value, flat, paths) for key, value in state.items()):
        return None
    return flat, paths


# The tensors that make most of a state, known to be leaves without asking what they hold.
_PLAIN_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter, DTensor})


# Functions of the module, not closures of flatten's: a closure that calls itself would hold the flat state, every
# tensor of it, until the collector's next pass.
def _visit(
    path: tuple[str | int, ...], key: str, value: Any, flat: dict[str, Any], paths: dict[str, tuple[str | int, ...]]
) -> bool:
    """Put ``value`` at ``path`` (``key`` flat) in ``flat`` and ``paths`` as :func:`flatten` does; ``False`` where it
    cannot."""
    if type(value) not in _PLAIN_TENSORS:
        if isinstance(value, dict):
            return all(_visit((*path, str(k)), f"{key}.{k!s}", item, flat, paths) for k, item in value.items())
        if isinstance(value, list) and _walked(value):
            return all(_visit((*path, n), f"{key}.{n}", item, flat, paths) for n, item in enumerate(value))
        if isinstance(value, Mapping) or hasattr(value, "local_shards"):
            return False
    if key in flat:
        return False
    flat[key], paths[key] = value, path
    return True


def _walked(value: list[Any]) -> bool:
    """Whether DCP walks the list ``value``: it holds a tensor, a mapping, or such a list."""
    for item in value:
        if isinstance(item, (Mapping, torch.Tensor)) or (isinstance(item, list) and _walked(item)):
            return True
    return False
