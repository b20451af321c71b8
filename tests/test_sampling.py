"""ResumableDistributedSampler: torch's DistributedSampler's indices, and a run stopped mid-epoch resumes at the next
sample, bitwise on the same world size, and on another one with every remaining sample seen once."""

import pytest
from ignite.engine import Engine, Events
from launcher import run_ranks
from resuming import DATA_SIZE, assert_resumed_as_uninterrupted, samples, train
from torch.utils.data import DataLoader, Dataset, DistributedSampler
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
@pytest.mark.parametrize(
    ("workers", "data_size", "epoch_length"), [(0, DATA_SIZE, None), (2, DATA_SIZE, None), (0, 65, 5)]
)
def test_a_run_resumed_mid_epoch_goes_on_bitwise(tmp_path, workers, data_size, epoch_length):
    """65 samples on 2 ranks pad the last batch of each epoch's data (11 iterations); with an ``epoch_length`` of 5,
    iteration 15 ends a trainer epoch in the middle of the data's."""
    daemon = workers == 0
    options = (None, False, data_size, epoch_length)
    uninterrupted = run_ranks(train, 2, tmp_path / "whole", "resumable", workers, None, *options, daemon=daemon)
    stopped = run_ranks(train, 2, tmp_path / "stopped", "resumable", workers, 15, *options, daemon=daemon)
    resumed = run_ranks(train, 2, tmp_path / "stopped", "resumable", workers, None, *options, daemon=daemon)
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


@pytest.mark.parametrize("size", [60, 65])
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("shuffle", [False, True])
def test_after_a_load_each_rank_gets_the_rest_of_torchs_indices(size, world_size, shuffle):
    """On the same world size a position is a multiple of it, and the rest is padded as torch pads the whole order."""
    for rank in range(world_size):
        options = {"num_replicas": world_size, "rank": rank, "shuffle": shuffle, "seed": 5}
        ours = ResumableDistributedSampler(range(size), Engine(lambda *_: None), **options)
        ours.load_state_dict({"epoch": 1, "position": 4 * world_size, "dataset_size": size})
        torchs = DistributedSampler(range(size), **options)
        torchs.set_epoch(1)
        assert list(ours) == list(torchs)[4:]


def test_without_a_process_group_it_is_the_only_rank():
    sampler = ResumableDistributedSampler(range(5), Engine(lambda *_: None), shuffle=False)
    assert (sampler.num_replicas, sampler.rank, list(sampler)) == (1, 0, [0, 1, 2, 3, 4])


class _CountedReads(Dataset):
    """``samples()``, counting the samples read in this process."""

    def __init__(self) -> None:
        self.samples = samples()
        self.reads = 0

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple:
        self.reads += 1
        return self.samples[index]


def _batches_seen(loader_kind, workers: int, stop_at: int | None, saved: dict) -> tuple[list[list[int]], int]:
    """One process, 2 epochs of 15 batches of 4 through ``loader_kind`` over the sampler; with ``stop_at``, the
    trainer's and the sampler's states are put in ``saved`` there and the run stops; else the run resumes from
    ``saved`` if it holds anything. Returns the samples of each batch and how many samples this process read."""
    seen: list[list[int]] = []
    trainer = Engine(lambda _, batch: seen.append(batch[1].tolist()))
    dataset = _CountedReads()
    sampler = ResumableDistributedSampler(dataset, trainer, num_replicas=1, rank=0, seed=2)
    if stop_at is not None:

        @trainer.on(Events.ITERATION_COMPLETED(once=stop_at))
        def save_and_stop(engine: Engine) -> None:
            saved.update(trainer=engine.state_dict(), sampler=sampler.state_dict())
            engine.terminate()

    elif saved:
        trainer.load_state_dict(saved["trainer"])
        sampler.load_state_dict(saved["sampler"])
    trainer.run(loader_kind(dataset, batch_size=4, sampler=sampler, num_workers=workers), max_epochs=2)
    return seen, dataset.reads


@pytest.mark.parametrize(("loader_kind", "workers"), [(DataLoader, 0), (StatefulDataLoader, 2)])
def test_resumed_it_reads_only_the_rest_and_any_loader_reads_it_once_an_epoch(loader_kind, workers):
    """torchdata's StatefulDataLoader with workers makes an iterator of the sampler that it never reads: that must not
    move the sampler to the next epoch, nor drop its loaded position."""
    uninterrupted, _ = _batches_seen(DataLoader, 0, None, {})
    saved: dict = {}
    stopped, _ = _batches_seen(loader_kind, workers, 20, saved)
    resumed, reads = _batches_seen(loader_kind, workers, None, saved)
    assert stopped + resumed == uninterrupted
    if workers == 0:  # the workers' reads are theirs
        assert reads == 4 * len(resumed)


def test_a_loader_that_drops_the_last_partial_batch_ends_the_epoch_at_its_last_whole_batch():
    trainer = Engine(lambda *_: None)
    sampler = ResumableDistributedSampler(samples(), trainer, num_replicas=1, rank=0)
    states = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda: states.append(sampler.state_dict()["epoch"]))
    trainer.run(DataLoader(samples(), batch_size=7, sampler=sampler, drop_last=True), max_epochs=1)
    assert states == [0] * 7 + [1]


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
    with pytest.raises(RuntimeError, match="put the sampler in `to_save` instead of the data loader"):
        trainer.run(loader, max_epochs=1)


def test_loaded_in_a_handler_of_the_run_it_says_to_load_before_the_run():
    trainer, sampler, loader = _trainer_over()
    trainer.add_event_handler(
        Events.STARTED, lambda: sampler.load_state_dict({"epoch": 0, "position": 8, "dataset_size": DATA_SIZE})
    )
    with pytest.raises(RuntimeError, match=r"last event is Events.STARTED.*Load it before trainer.run"):
        trainer.run(loader, max_epochs=1)
