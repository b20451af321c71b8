"""The torch releases ignite_zero supports: the floor it refuses to import below, and the running release.

Every other module of :mod:`ignite_zero._compat` is written for the releases from this floor on, so raising it is
where dropping a workaround starts.
"""

from __future__ import annotations

import torch
from packaging.version import Version

__all__ = ["MIN_TORCH_VERSION", "TORCH_VERSION"]

#: Oldest torch release this package supports: the oldest on which the whole suite is known to pass. Older
#: releases fail it for reasons of their own:
#: - 2.10, 2.9: ``torch.load(..., map_location="meta")`` sets no ``_checkpoint_offset`` on the storages (2.10 sets
#:   it under a fake tensor mode only), so :func:`~ignite_zero._compat.serialization.storage_offset_in_file`
#:   refuses, and checkpoint files on an object store cannot be read in parts;
#: - 2.8, 2.7: ``dcp.async_save`` takes no ``no_dist`` (``dcp.save`` does from 2.7 on), so an asynchronous sharded
#:   save written by one rank alone fails; bridging it would take a process group of that rank alone for each such
#:   save, and the next difference rules these releases out anyway;
#: - 2.8, 2.7: FSDP2 over gloo sums the gradients of the ranks instead of averaging them, so training differs from
#:   the unsharded twin the suite compares with; the checkpoints themselves hold what FSDP2 computed;
#: - 2.6: FSDP2 cannot run a forward on CPU (``'Stream' object has no attribute 'record_event'``), and
#:   ``dcp.save`` takes no ``no_dist`` either.
MIN_TORCH_VERSION = Version("2.11")
TORCH_VERSION = Version(Version(torch.__version__).base_version)

if TORCH_VERSION < MIN_TORCH_VERSION:  # pragma: no cover - guarded by install_requires
    raise ImportError(f"ignite_zero needs torch>={MIN_TORCH_VERSION}, found {torch.__version__}")
