"""The one place where torch, ignite and fairscale versions are compared and their private internals touched.

Each module adapts to one upstream part, so that raising the supported floor, or following an upstream change,
means editing that module alone:

- :mod:`~ignite_zero._compat.torch_version`: the supported torch releases;
- :mod:`~ignite_zero._compat.ignite_events`: ignite's checkpoint events;
- :mod:`~ignite_zero._compat.ignite_engine`: the order of an ignite ``Engine``'s handlers;
- :mod:`~ignite_zero._compat.process_groups`: the default process group's store;
- :mod:`~ignite_zero._compat.sharded_optimizers`: ``ZeroRedundancyOptimizer`` and fairscale's ``OSS``;
- :mod:`~ignite_zero._compat.serialization`: ``torch.save``'s archive and ``torch.load``'s offsets;
- :mod:`~ignite_zero._compat.dcp`: torch.distributed.checkpoint;
- :mod:`~ignite_zero._compat.dtensor`: DTensor layouts, and DTensors of given local tensors;
- :mod:`~ignite_zero._compat.foreach`: torch's multi-tensor kernels;
- :mod:`~ignite_zero._compat.modules`: ``nn.Module``'s non-persistent buffers and extra state, torch's wrappers;
- :mod:`~ignite_zero._compat.fsdp1`: FSDP1's ``FlatParameter``;
- :mod:`~ignite_zero._compat.fairscale_fsdp`: fairscale's ``FullyShardedDataParallel``.

Callers import every name from this package, which re-exports them.
"""

from __future__ import annotations

from ignite_zero._compat.dcp import (
    DCP_VERSION,
    DcpFsspecReader,
    DcpFsspecWriter,
    dcp_entry_path,
    dcp_flatten,
    dcp_metadata_globals,
    dcp_storage_info,
)
from ignite_zero._compat.dtensor import (
    dtensor_block,
    dtensor_detached,
    dtensor_layout,
    dtensor_local,
    dtensor_of_local,
    unsupported_placement,
)
from ignite_zero._compat.fairscale_fsdp import (
    FAIRSCALE_WRAPPER_SEGMENTS,
    FairscaleParamEntry,
    FairscaleShardedParam,
    check_fairscale_fsdp_layout,
    fairscale_fsdp_class,
    fairscale_fsdp_params,
    fairscale_release_full_params,
    fairscale_shares_across_units,
    fairscale_version,
    is_fairscale_fsdp,
    is_fairscale_fsdp_param,
)
from ignite_zero._compat.foreach import copy_each
from ignite_zero._compat.fsdp1 import (
    FlatParamEntry,
    SharedParamEntry,
    check_fsdp1_layout,
    fsdp1_flat_param,
    fsdp1_local_shard,
    fsdp1_orig_params,
    fsdp1_param_entries,
    fsdp1_shared_entries,
    is_fsdp_flattened,
)
from ignite_zero._compat.ignite_engine import add_first_event_handler
from ignite_zero._compat.ignite_events import CheckpointEvents
from ignite_zero._compat.modules import (
    EXTRA_STATE_KEY,
    TORCH_WRAPPER_SEGMENTS,
    load_module_state,
    non_persistent_buffer_names,
)
from ignite_zero._compat.optimizers import load_optimizer_state
from ignite_zero._compat.process_groups import default_store
from ignite_zero._compat.serialization import (
    SavedStorage,
    reduce_plain_tensor,
    saved_storage,
    serialization_crc32,
    storage_alignment,
    storage_archive_version,
    storage_offset_in_file,
)
from ignite_zero._compat.sharded_optimizers import (
    consolidated_state_attribute,
    sharded_optimizer_kind,
    zero_awaits_ddp,
)
from ignite_zero._compat.torch_version import MIN_TORCH_VERSION, TORCH_VERSION

__all__ = [
    "copy_each",
    "DCP_VERSION",
    "EXTRA_STATE_KEY",
    "FAIRSCALE_WRAPPER_SEGMENTS",
    "MIN_TORCH_VERSION",
    "TORCH_VERSION",
    "TORCH_WRAPPER_SEGMENTS",
    "CheckpointEvents",
    "DcpFsspecReader",
    "DcpFsspecWriter",
    "FairscaleParamEntry",
    "FairscaleShardedParam",
    "FlatParamEntry",
    "SavedStorage",
    "SharedParamEntry",
    "add_first_event_handler",
    "check_fairscale_fsdp_layout",
    "check_fsdp1_layout",
    "consolidated_state_attribute",
    "dcp_entry_path",
    "dcp_flatten",
    "dcp_metadata_globals",
    "dcp_storage_info",
    "default_store",
    "dtensor_block",
    "dtensor_detached",
    "dtensor_layout",
    "dtensor_local",
    "dtensor_of_local",
    "fairscale_fsdp_class",
    "fairscale_fsdp_params",
    "fairscale_release_full_params",
    "fairscale_shares_across_units",
    "fairscale_version",
    "fsdp1_flat_param",
    "fsdp1_local_shard",
    "fsdp1_orig_params",
    "fsdp1_param_entries",
    "fsdp1_shared_entries",
    "is_fairscale_fsdp",
    "is_fairscale_fsdp_param",
    "is_fsdp_flattened",
    "load_module_state",
    "load_optimizer_state",
    "non_persistent_buffer_names",
    "reduce_plain_tensor",
    "saved_storage",
    "serialization_crc32",
    "sharded_optimizer_kind",
    "storage_alignment",
    "storage_archive_version",
    "storage_offset_in_file",
    "unsupported_placement",
    "zero_awaits_ddp",
]
