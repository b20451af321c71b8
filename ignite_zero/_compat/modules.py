"""``torch.nn.Module`` internals: which buffers a module leaves out of its state, the key of its extra state, and the
name segments that torch's wrappers insert.

The FSDP adapters list a module's state buffer by buffer without calling ``state_dict()`` (which would unshard
it), and so name each entry as ``state_dict()`` would from what ``nn.Module`` and its wrappers keep privately.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

__all__ = ["EXTRA_STATE_KEY", "TORCH_WRAPPER_SEGMENTS", "non_persistent_buffer_names"]

# The key of a module's get_extra_state() in its state dict (nn.Module's private _EXTRA_STATE_KEY_SUFFIX).
EXTRA_STATE_KEY = "_extra_state"

# The attributes torch's wrappers keep the wrapped module in, so segments of the names under them that the unwrapped
# module's state_dict() lacks: FSDP1's FullyShardedDataParallel, activation checkpointing's CheckpointWrapper,
# torch.compile's OptimizedModule (DSD drops the same ones).
TORCH_WRAPPER_SEGMENTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})


def non_persistent_buffer_names(module: nn.Module) -> set[str]:
    """Names of ``module``'s own buffers that ``state_dict()`` leaves out."""
    return set(getattr(module, "_non_persistent_buffers_set", ()))
