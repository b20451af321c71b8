"""The saver protocol (:mod:`ignite_zero.storage.savers.base`) is the only seam between policy and storage: a saver
of one's own, written against the protocol alone, plugs into Checkpoint."""

from collections.abc import Mapping

import pytest
from ignite.engine import Engine, Events
from launcher import run_ranks
from training import assert_state_equal, tiny_model, train_step, zero_adam

from ignite_zero import Checkpoint
from ignite_zero.storage import ConsolidatingSaver, SaveRequest


class MemorySaver(ConsolidatingSaver):
    """Keeps checkpoints in a dict on the recipient: a saver written against the protocol alone."""

    def __init__(self):
        self.held = {}

    def writes_here(self, request: SaveRequest) -> bool:
        return request.is_recipient

    def write(self, content, request: SaveRequest) -> None:
        self(content, request.filename, request.metadata)

    def __call__(self, checkpoint: Mapping, filename: str, metadata=None) -> None:
        self.held[filename] = checkpoint

    def remove(self, filename: str) -> None:
        del self.held[filename]

    def list(self) -> list[str]:
        return sorted(self.held)


def _own_saver(rank, world_size):
    model = tiny_model()
    optimizer = zero_adam(model)
    trainer = Engine(lambda engine, _: train_step(model, optimizer, rank, engine.state.iteration))
    saver = MemorySaver()
    handler = Checkpoint({"model": model, "optimizer": optimizer}, saver, n_saved=2, consolidate_recipient_rank=1)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, handler)
    trainer.run(range(2), max_epochs=3)
    optimizer.consolidate_state_dict(to=1)
    expected = optimizer.state_dict() if rank == 1 else None
    return saver.list(), handler.last_checkpoint, saver.held.get("checkpoint_6.pt"), expected


@pytest.mark.distributed
def test_a_saver_of_ones_own_plugs_in_through_the_protocol():
    (names0, last0, held0, _), (names1, last1, held1, expected) = run_ranks(_own_saver, 2)
    assert names0 == [] and held0 is None  # only the recipient writes
    assert names1 == ["checkpoint_4.pt", "checkpoint_6.pt"] and last0 == last1 == "checkpoint_6.pt"
    assert_state_equal(held1["optimizer"], expected)
