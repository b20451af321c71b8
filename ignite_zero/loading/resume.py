"""Where a resumed :class:`~ignite_zero.Checkpoint` carries on: the checkpoints it keeps once the newest valid one
is loaded."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ignite_zero.agreement import settle
from ignite_zero.naming import global_step_of
from ignite_zero.storage import Saver

__all__ = ["listed_on_every_rank", "retention_until"]


def listed_on_every_rank(saver: Saver, timeout: float) -> list[str]:
    """Every name that any rank lists in ``saver``'s directory, sorted; a collective.

    Node-local directories differ (a replaced host's is nearly empty), and retention taken from one of them alone
    would never remove the older checkpoints that only the others hold.
    """
    listings = settle(None, what="listing of the checkpoints", timeout=timeout, payload=saver.list())
    return sorted({listed for listing in listings for listed in listing})


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
