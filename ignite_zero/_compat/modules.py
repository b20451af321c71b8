"""``torch.nn.Module`` internals: which buffers a module leaves out of its state.

The FSDP adapters list a module's state buffer by buffer without calling ``state_dict()`` (which would unshard
it), and ``nn.Module`` keeps its non-persistent buffers in a private set.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

__all__ = ["non_persistent_buffer_names"]


def non_persistent_buffer_names(module: nn.Module) -> set[str]:
    """Names of ``module``'s own buffers that ``state_dict()`` leaves out."""
    return set(getattr(module, "_non_persistent_buffers_set", ()))
