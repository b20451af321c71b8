"""Where a resumed :class:`~ignite_zero.Checkpoint` carries on: whether its saver can go on saving where it resumed,
and the checkpoints it keeps once the newest valid one is loaded."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ignite_zero.agreement import together
from ignite_zero.naming import global_step_of
from ignite_zero.storage import Saver
from ignite_zero.storage.places import place_of

__all__ = ["ready_to_save_after", "retention_until"]


def ready_to_save_after(
    saver: Saver,
    found: str | None,
    places: Sequence[str | Path] | None,
    options: Mapping[str, Any] | None,
    *,
    filename_prefix: str,
    timeout: float,
) -> list[str]:
    """Make ``saver`` ready to save after :meth:`~ignite_zero.Checkpoint.load_latest` found ``found`` in ``places``
    (its own directory where ``None``): its checkpoints there are this run's, whichever tier is newest, so
    ``require_empty`` lets them be. Then what would make its next save fail is raised now on every rank (its
    :meth:`~Saver.check`, led by how the resume left its directory), else every name that any rank lists in its
    directory is returned, sorted; a collective.

    Node-local directories differ (a replaced host's is nearly empty), and retention taken from one of them alone
    would never remove the older checkpoints that only the others hold.

    Raises:
        RankFailureError: the check failed on some rank (without a process group, its own error, in context).
    """
    searched_own = places is None or str(saver.directory) in {str(place_of(p, options).location()) for p in places}
    if found is not None and searched_own:
        saver.allow_existing_checkpoints()
    context = _resume_context(found, searched_own, saver.directory, filename_prefix)
    with together("check of the saver before resuming", timeout=timeout) as listing:
        try:
            saver.check()
        except Exception as error:
            placed = _in_context(error, context)
            if placed is None:
                raise
            raise placed from error
        listing.payload = saver.list()
    return sorted({listed for names in listing.payloads for listed in names})


def _resume_context(found: str | None, searched_own: bool, directory: Any, filename_prefix: str) -> str:
    """How the resume left a handler's ``directory`` after finding ``found`` (``searched_own``: among the places
    it searched), to lead an error of its saver's check."""
    if found is not None and searched_own:
        return f"load_latest resumes {found}, but this handler cannot save after it"
    if found is not None:
        return (
            f"load_latest resumes {found}, and this handler's own directory, {directory}, is not among `places`: "
            "its saves start afresh there (add it to `places` if its checkpoints are this run's)"
        )
    prefix = filename_prefix and f" (it looks for names that start with '{filename_prefix}_')"
    return (
        f"load_latest found no checkpoint of this handler to resume{prefix}, so its saves start afresh (if the "
        "checkpoints there are this run's, give the handler the `filename_prefix` they were saved with)"
    )


def _in_context(error: Exception, context: str) -> Exception | None:
    """An error of ``error``'s type, its message led by ``context``; ``None`` where the type takes other arguments
    (it is then raised as it is)."""
    try:
        return type(error)(f"{context}: {error}")
    except Exception:
        return None


def retention_until(
    last: str,
    listed: Sequence[str],
    *,
    own: bool,
    priority_in: Callable[[str], int | float | None],
    n_saved: int | None,
) -> list[tuple[int | float, str]]:
    """The ``(priority, filename)`` pairs a handler keeps once ``last`` is its newest checkpoint: its own names
    among those ``listed`` in its directory, read back by ``priority_in`` (``None`` for another handler's name), up
    to ``last``, at most ``n_saved``. Where ``last`` is another handler's (``own`` False: another tier), it is no
    name of this one's to keep."""
    pairs = [(priority, name) for name in listed if (priority := priority_in(name)) is not None]
    ceiling = priority_in(last) if own else global_step_of(last)
    # of its own checkpoints at another tier's step, none verified (else it would be newest): none is retained
    kept = sorted(pair for pair in pairs if ceiling is None or pair[0] < ceiling or (own and pair[0] == ceiling))
    kept = [pair for pair in kept if pair[1] != last]
    if own:
        kept.append((ceiling if ceiling is not None else 0, last))
    return kept if n_saved is None else kept[-n_saved:]
