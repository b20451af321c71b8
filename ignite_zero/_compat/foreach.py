"""torch's multi-tensor kernels (``torch._foreach_*``): one call for a list of tensors, where a loop in Python pays
the interpreter and the dispatcher once per tensor."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["copy_each"]


def copy_each(targets: Sequence[torch.Tensor], sources: Sequence[torch.Tensor], non_blocking: bool = False) -> None:
    """``target.copy_(source)`` for each pair, outside autograd, in one call (a loop where this torch has no such
    kernel).

    Args:
        targets: the tensors copied into.
        sources: as many tensors, each of its target's shape.
        non_blocking: as for ``Tensor.copy_``.
    """
    copy = getattr(torch, "_foreach_copy_", None)
    with torch.no_grad():
        if copy is None or not targets:
            for target, source in zip(targets, sources):
                target.copy_(source, non_blocking=non_blocking)
        else:
            copy(list(targets), list(sources), non_blocking=non_blocking)
