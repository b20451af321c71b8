"""Checkpoint names: the names :class:`~ignite_zero.Checkpoint` writes, and how a name is read back.

A name is ignite's file name pattern filled in, by default
``{filename_prefix}_{name}_{global_step}_{score_name}={score}.{ext}`` less the parts a handler does not use (see
``ignite.handlers.Checkpoint.setup_filename_pattern``). One rule reads a name back, for :class:`Checkpoint
<ignite_zero.Checkpoint>` (its retention after a resume) and :func:`~ignite_zero.find_latest` (which is newest)
alike: the pattern must match the whole name, with the prefix, the score name and the extension as written, the
``name`` any run of characters without ``/``, the score a decimal number, and the global step digits.
:func:`~ignite_zero.find_latest` knows no handler's pattern: it reads a name with ignite's default patterns that
hold a global step, whatever the score name.
"""

from __future__ import annotations

import os
import re

__all__ = ["check_filename", "global_step_of", "read_name"]

_NAME = r"[^/]+?"
_SCORE = r"(?P<score>-?[0-9.]+(?:e[-+]?[0-9]+)?)"
_GLOBAL_STEP = r"(?P<global_step>[0-9]+)"
_ANY_SCORE_NAME = r"[^_=/]+"

# ignite's default patterns that end with a global step, as setup_filename_pattern makes them (the prefix is part of
# ``{name}`` here), with a score name and its score, or without a score. Not ``..._{global_step}_{score}``: in
# ``model_12_3.pt`` nothing tells a step 12 of score 3 from a step 3, and the number that ends a name is its step.
_DEFAULT_WITH_STEP = ("{name}_{global_step}_{score_name}={score}.{ext}", "{name}_{global_step}.{ext}")


def check_filename(filename: str) -> str:
    """Reject a checkpoint file name that would be written outside its directory; return it otherwise.

    Raises:
        ValueError: for an empty name, an absolute path, a path separator, ``.`` or ``..``.
    """
    separators = {os.sep, "/"} | ({os.altsep} if os.altsep else set())
    if not filename or filename in (".", "..") or any(s in filename for s in separators) or "\0" in filename:
        raise ValueError(
            f"Checkpoint file name {filename!r} is not a plain file name: it would be written outside the target "
            "directory. Remove path separators and '..' from `filename_prefix`, `score_name` and `filename_pattern`."
        )
    return filename


def read_name(
    filename: str, pattern: str, *, ext: str, filename_prefix: str = "", score_name: str | None = None
) -> dict[str, str | None] | None:
    """What ``pattern`` put in ``filename``: its ``score`` and ``global_step`` (``None`` where the pattern has none);
    ``None`` if the name does not match the pattern.

    Args:
        filename: the name to read.
        pattern: an ignite file name pattern, e.g. ``"{filename_prefix}_{name}_{global_step}.{ext}"``.
        ext: the extension, as written.
        filename_prefix: the prefix, as written.
        score_name: the score name, as written; ``None`` for any.
    """
    fields = {
        "filename_prefix": re.escape(filename_prefix),
        "ext": re.escape(ext),
        "name": _NAME,
        "score_name": _ANY_SCORE_NAME if score_name is None else re.escape(score_name),
        "score": _SCORE,
        "global_step": _GLOBAL_STEP,
    }
    regex = re.escape(pattern).replace(r"\{", "{").replace(r"\}", "}").format(**fields)
    match = re.fullmatch(regex, filename)
    if match is None:
        return None
    found = match.groupdict()
    return {"score": found.get("score"), "global_step": found.get("global_step")}


def global_step_of(filename: str) -> int | None:
    """The global step (or iteration) in a name of one of ignite's default patterns that hold one:
    ``checkpoint_300.pt``, ``best_model_300_acc=0.9000.pt``; ``None`` for any other name."""
    _, dot, ext = filename.rpartition(".")
    if not dot:
        return None
    for pattern in _DEFAULT_WITH_STEP:
        found = read_name(filename, pattern, ext=ext)
        if found is not None and found["global_step"] is not None:
            return int(found["global_step"])
    return None
