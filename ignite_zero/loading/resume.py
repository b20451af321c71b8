"""Where a resumed :class:`~ignite_zero.Checkpoint` carries on: whether its saver can go on saving where it resumed,
and the checkpoints it keeps once the newest valid one is loaded."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ignite_zero.agreement import settle
from ignite_zero.naming import global_step_of
from ignite_zero.storage import Saver

__all__ = ["checked_and_listed", "retention_until"]


def checked_and_listed(saver: Saver, timeout: float, *, context: str) -> list[str]:
    """What would make ``saver``'s next save fail, raised now on every rank (its :meth:`~Saver.check`, the message
    led by ``context``: how the resume left its directory), else every name that any rank lists in its directory,
    sorted; a collective.

    Node-local directories differ (a replaced host's is nearly empty), and retention taken from one of them alone
    would never remove the older checkpoints that only the others hold.

    Raises:
        RankFailureError: the check failed on some rank (without a process group, its own error, in context).
    """
    failure: BaseException | None = None
    listing: list[str] = []
    try:
        saver.check()
        listing = saver.list()
    except Exception as error:
        failure = _in_context(error, context)
    listings = settle(failure, what="check of the saver before resuming", timeout=timeout, payload=listing)
    return sorted({listed for listing in listings for listed in listing})


def _in_context(error: Exception, context: str) -> BaseException:
    """``error`` of the same type, its message led by ``context``; ``error`` itself where its type takes other
    arguments."""
    try:
        placed = type(error)(f"{context}: {error}")
    except Exception:  # a type that cannot be built from a message alone keeps its own
        return error
    placed.__cause__ = error
    return placed


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
