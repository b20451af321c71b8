"""ignite's ``ModelCheckpoint``, as a :class:`~ignite_zero.Checkpoint` that writes with a
:class:`~ignite_zero.DiskSaver` made from a directory and is given what to save when attached."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ignite.engine import Engine

from ignite_zero import tree
from ignite_zero.agreement import DEFAULT_SYNC_TIMEOUT
from ignite_zero.checkpoint import Checkpoint
from ignite_zero.save_ranks import resolve_recipient
from ignite_zero.storage import saver_for

__all__ = ["ModelCheckpoint"]


class ModelCheckpoint(Checkpoint):
    """Drop-in for :class:`ignite.handlers.ModelCheckpoint`: a :class:`Checkpoint` writing with a
    :class:`~ignite_zero.DiskSaver`, given ``to_save`` when attached.

    Args:
        dirname: directory in which checkpoints are written.
        filename_prefix: prefix of the file names.
        score_function: ``engine -> number``; the highest scores are kept.
        score_name: name of the score in file names.
        n_saved: how many files to keep; ``None`` keeps all.
        atomic: write to a temporary file and rename it (default).
        require_empty: raise if ``dirname`` already holds ``.pt`` files.
        create_dir: create ``dirname`` if needed.
        global_step_transform: ``(engine, event_name) -> int`` global step for file names.
        filename_pattern: pattern of file names.
        include_self: also save this handler's own state.
        greater_or_equal: keep the latest of equally scored checkpoints.
        save_on_rank: ignite's name for the writing rank.
        consolidate_recipient_rank: rank that receives the consolidated state and writes it.
        sync_timeout: seconds every rank waits for the others to reach the same save.
        async_save: save in the background (see :class:`Checkpoint`).
        kwargs: keyword arguments of :func:`torch.save`.

    Examples:
        .. code-block:: python

            from ignite_zero import ModelCheckpoint

            handler = ModelCheckpoint("models", "run", n_saved=2, require_empty=False)
            trainer.add_event_handler(Events.EPOCH_COMPLETED, handler, {"model": model, "optimizer": optimizer})

    .. versionadded:: 0.1.0
    """

    def __init__(
        self,
        dirname: str | Path,
        filename_prefix: str = "",
        score_function: Callable | None = None,
        score_name: str | None = None,
        n_saved: int | None = 1,
        atomic: bool = True,
        require_empty: bool = True,
        create_dir: bool = True,
        global_step_transform: Callable | None = None,
        filename_pattern: str | None = None,
        include_self: bool = False,
        greater_or_equal: bool = False,
        save_on_rank: int | None = None,
        *,
        consolidate_recipient_rank: int | None = None,
        sync_timeout: float = DEFAULT_SYNC_TIMEOUT,
        async_save: bool = False,
        **kwargs: Any,
    ) -> None:
        recipient = resolve_recipient(consolidate_recipient_rank, save_on_rank, None)
        saver = saver_for(
            dirname, atomic=atomic, create_dir=create_dir, require_empty=require_empty, save_on_rank=recipient, **kwargs
        )
        super().__init__(
            to_save={},
            save_handler=saver,
            filename_prefix=filename_prefix,
            score_function=score_function,
            score_name=score_name,
            n_saved=n_saved,
            global_step_transform=global_step_transform,
            filename_pattern=filename_pattern,
            include_self=include_self,
            greater_or_equal=greater_or_equal,
            consolidate_recipient_rank=recipient,
            sync_timeout=sync_timeout,
            async_save=async_save,
        )

    @property
    def last_checkpoint(self) -> str | Path | None:
        if not self._retained():
            return None
        if self.saver.directory is None:
            raise RuntimeError(f"Internal error, save_handler should be DiskSaver, but has {type(self.save_handler)}.")
        return super().last_checkpoint

    def __call__(self, engine: Engine, to_save: Mapping) -> None:  # type: ignore[override]
        if len(to_save) == 0:
            raise RuntimeError("No objects to checkpoint found.")
        tree.check_methods(to_save, "state_dict")
        self.to_save = to_save
        super().__call__(engine)
