"""ResumableDistributedSampler: torch's DistributedSampler's indices, and a run stopped mid-epoch resumes at the next
sample, bitwise on the same world size, and on another one with every remaining sample seen once."""

import pytest
from ignite.engine import Engine, Events
from launcher import run_ranks
from resuming import DATA_SIZE, assert_resumed_as_uninterrupted, samples, train
from torch.utils.data import DataLoader, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from ignite_zero import ResumableDistributedSampler


@pytest.mark.parametrize("size", [60, 61, 2])
@pytest.mark.parametrize("world_size", [1, 3, 4])
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
def test_each_rank_gets_the_indices_of_torchs_distributed_sampler(size, world_size, shuffle, drop_last):
    for rank in range(world_size):
        options = {"num_replicas": world_size, "rank": rank, "shuffle": shuffle, "seed": 5, "drop_last": drop_last}
        ours = ResumableDistributedSampler(range(size), Engine(lambda *_: None), **options)
        torchs = DistributedSampler(range(size), **options)
        for epoch in range(2):
            torchs.set_epoch(epoch)  # ours moves to the next epoch by itself
            assert list(ours) == list(torchs)


@pytest.mark.distributed
@pytest.mark.parametrize("workers", [0, 2])
def test_a_run_resumed_mid_epoch_goes_on_bitwise_without_reading_the_skipped_batches(tmp_path, workers):
    daemon = workers == 0
    uninterrupted = run_ranks(train, 2, tmp_path / "whole", "resumable", workers, daemon=daemon)
    stopped = run_ranks(train, 2, tmp_path / "stopped", "resumable", workers, 15, daemon=daemon)
    resumed = run_ranks(train, 2, tmp_path / "stopped", "resumable", workers, daemon=daemon)
    assert_resumed_as_uninterrupted(stopped, resumed, uninterrupted)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [3, 1])
def test_on_another_world_size_the_rest_of_the_epoch_is_seen_once_across_the_new_ranks(tmp_path, world_size):
    """2 ranks stop at iteration 15, the middle of the second epoch, and resume on ``world_size`` ranks until the
    epoch's data ends: what the two runs saw of that epoch is the whole data set, each sample once."""
    stopped = run_ranks(train, 2, tmp_path, "resumable", 0, 15)
    resumed = run_ranks(train, world_size, tmp_path, "resumable", 0, None, None, True)
    seen = [index for rank in stopped for batch in rank["seen"][10:] for index in batch]
    seen += [index for rank in resumed for batch in rank["seen"] for index in batch]
    assert sorted(seen) == list(range(DATA_SIZE))


def _trainer_over(loader_kind=DataLoader, **options):
    trainer = Engine(lambda *_: None)
    sampler = ResumableDistributedSampler(samples(), trainer, num_replicas=1, rank=0, **options)
    return trainer, sampler, loader_kind(samples(), batch_size=4, sampler=sampler)


def test_the_state_is_the_position_the_trainer_consumed_and_the_next_epoch_at_its_end():
    trainer, sampler, loader = _trainer_over()
    trainer.add_event_handler(Events.ITERATION_COMPLETED(once=4), Engine.terminate)
    trainer.run(loader, max_epochs=2)
    assert sampler.state_dict() == {"epoch": 0, "position": 16, "dataset_size": DATA_SIZE}
    trainer.run(loader, max_epochs=2)
    assert sampler.state_dict() == {"epoch": 2, "position": 0, "dataset_size": DATA_SIZE}


def test_a_state_of_another_data_set_or_sampler_is_a_clear_error():
    _, sampler, _ = _trainer_over()
    with pytest.raises(ValueError, match="data set of 59 samples, and this one has 60"):
        sampler.load_state_dict({"epoch": 1, "position": 3, "dataset_size": 59})
    with pytest.raises(ValueError, match=r"lacks \['dataset_size', 'position'\]"):
        sampler.load_state_dict({"epoch": 1})


def test_a_trainer_on_data_other_than_its_loader_is_a_clear_error():
    """The loader's batches reach the trainer through a generator: the trainer cannot say how many samples it
    consumed."""
    trainer, sampler, loader = _trainer_over()
    trainer.add_event_handler(Events.ITERATION_COMPLETED(once=2), lambda: sampler.state_dict())
    with pytest.raises(RuntimeError, match="not a data loader over this ResumableDistributedSampler"):
        trainer.run((batch for batch in loader), max_epochs=1, epoch_length=5)


def test_restored_by_a_stateful_dataloader_it_says_to_save_the_sampler_instead():
    trainer, _, loader = _trainer_over(StatefulDataLoader)
    trainer.add_event_handler(Events.ITERATION_COMPLETED(once=3), Engine.terminate)
    trainer.run(loader, max_epochs=1)
    state = loader.state_dict()
    trainer, _, loader = _trainer_over(StatefulDataLoader)
    loader.load_state_dict(state)
    with pytest.raises(RuntimeError, match="Put the sampler in `to_save` instead of the data loader"):
        trainer.run(loader, max_epochs=1)
