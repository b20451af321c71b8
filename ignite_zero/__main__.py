"""``python -m ignite_zero``: the ``ignite-zero`` command line."""

from ignite_zero.cli import main

raise SystemExit(main())
