"""An engine that does nothing, saved at the iterations a test chooses: for the tests of what one save writes."""

from typing import Any

from ignite.engine import Engine

__all__ = ["idle_engine", "save_at"]


def idle_engine() -> Engine:
    """An engine at iteration 0 that never runs."""
    engine = Engine(lambda e, b: None)
    engine.state.iteration = 0
    return engine


def save_at(handler: Any, engine: Engine, iteration: int) -> None:
    """Call ``handler`` as if ``engine`` had reached ``iteration``."""
    engine.state.iteration = iteration
    handler(engine)
