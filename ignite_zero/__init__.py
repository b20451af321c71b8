"""ignite_zero: correct, cheap and boring checkpoints of sharded PyTorch training state for PyTorch-Ignite."""

from ignite_zero.adapters import (
    FairscaleFSDPModelState,
    FairscaleFSDPOptimizerState,
    FSDPModelState,
    FSDPOptimizerState,
    PerRank,
    ShardedState,
    ZeROState,
)
from ignite_zero.agreement import DEFAULT_SYNC_TIMEOUT, CollectiveTimeoutError, RankFailureError
from ignite_zero.checkpoint import Checkpoint
from ignite_zero.exporting import export
from ignite_zero.handlers import ConsolidateZeROHandler, SaveOnSignal
from ignite_zero.loading.latest import find_latest
from ignite_zero.model_checkpoint import ModelCheckpoint
from ignite_zero.rng import RandomState
from ignite_zero.sampling import ResumableDistributedSampler
from ignite_zero.storage import DiskSaver, ShardedSaver
from ignite_zero.storage.formats.base import IntegrityError, UnsafeCheckpointError
from ignite_zero.storage.formats.file_verification import verify_file

__all__ = [
    "DEFAULT_SYNC_TIMEOUT",
    "Checkpoint",
    "CollectiveTimeoutError",
    "ConsolidateZeROHandler",
    "DiskSaver",
    "FairscaleFSDPModelState",
    "FairscaleFSDPOptimizerState",
    "FSDPModelState",
    "FSDPOptimizerState",
    "IntegrityError",
    "UnsafeCheckpointError",
    "ModelCheckpoint",
    "PerRank",
    "RandomState",
    "RankFailureError",
    "ResumableDistributedSampler",
    "SaveOnSignal",
    "ShardedSaver",
    "ShardedState",
    "ZeROState",
    "__version__",
    "export",
    "find_latest",
    "verify_file",
]

__version__ = "0.1.0"
