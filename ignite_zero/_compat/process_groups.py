"""torch.distributed's process groups: the key-value store of the default group.

Ranks agree through that store (:mod:`ignite_zero.agreement.rounds`) without a collective of their own, and torch
keeps its accessor private.
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["default_store"]


def default_store() -> dist.Store:
    """The key-value store of the default process group (torch keeps the accessor private)."""
    return dist.distributed_c10d._get_default_store()
