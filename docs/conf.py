"""Sphinx configuration of ignite_zero's documentation: ``sphinx-build -W --keep-going -n docs docs/_build/html``."""

from __future__ import annotations

from typing import Any

from sphinx.util import logging

import ignite_zero

logger = logging.getLogger(__name__)

project = "ignite_zero"
author = "ignite_zero's authors"
copyright = "ignite_zero's authors"
release = version = ignite_zero.__version__

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode"]
exclude_patterns = ["_build"]
html_theme = "furo"
html_title = f"ignite_zero {release}"
# literal blocks (``::``) are tables and logs: no Python colouring of words such as min and max
highlight_language = "none"

# ignite's docstring style: Google sections, types in the signature and nowhere else
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_typehints = "signature"
autodoc_member_order = "bysource"

# The build is offline (CI reaches no documentation server), so torch's, ignite's and the standard library's names
# cannot be linked: nitpicky mode checks our own references only.
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|ignite|fsspec|numpy|collections|typing|pathlib|os|datetime|enum|abc|io)(\..*)?"),
    (r"py:.*", r"(Any|Path|Callable|Mapping|Sequence|Iterable|Iterator|Literal|Self|TypeGuard|NoneType)"),
]
# Types that public signatures and docstrings name but that are not public themselves: the storage protocols
# behind the savers, and their methods.
nitpick_ignore_regex += [
    (r"py:.*", r"ignite_zero\.storage\.(savers\.base\.Saver|places\.Place|formats\.file_trailer\.Stored)(\..*)?"),
]


def _require_a_docstring(app: Any, what: str, name: str, obj: Any, options: Any, lines: list[str]) -> None:
    """A documented name without a docstring fails the build (``-W``), as a broken reference does."""
    if not any(line.strip() for line in lines):
        logger.warning(f"{name} has no docstring: the API reference would show its signature alone")


def setup(app: Any) -> None:
    app.connect("autodoc-process-docstring", _require_a_docstring)
