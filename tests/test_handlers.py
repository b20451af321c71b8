"""SaveOnSignal on real gloo ranks: a signal on any rank makes every rank save the same iteration and stop, the run
resumes from that file, a second signal ends the process at once, and the previous signal handlers come back."""

import multiprocessing
import os
import signal
import threading
import time

import pytest
import torch
from ignite.engine import Engine, Events
from launcher import run_ranks
from resuming import assert_resumed_as_uninterrupted, train
from torch.nn.parallel import DistributedDataParallel
from training import assert_state_equal, tiny_model, train_step, zero_adam

from ignite_zero import Checkpoint, DiskSaver, SaveOnSignal, verify_file

pytestmark = pytest.mark.distributed

EPOCH_LENGTH, MAX_EPOCHS = 5, 4


def _trainer(model, optimizer, rank):
    return Engine(lambda engine, _: train_step(model, optimizer, rank, engine.state.iteration))


def _zero_job(rank):
    model = DistributedDataParallel(tiny_model())
    optimizer = zero_adam(model)
    trainer = _trainer(model, optimizer, rank)
    to_save = {"model": model, "optimizer": optimizer, "trainer": trainer}
    return model, trainer, to_save


def _send_at(trainer, iteration, kind):
    # Added after SaveOnSignal's own handler: the signal is noted after this boundary's look, read at the next one.
    trainer.add_event_handler(Events.ITERATION_COMPLETED(once=iteration), lambda _: os.kill(os.getpid(), kind))


def _stopped_by_a_signal(rank, world_size, dirname, sent, async_save=False):
    model, trainer, to_save = _zero_job(rank)
    checkpoint = Checkpoint(to_save, DiskSaver(dirname), n_saved=None, async_save=async_save)
    stop = SaveOnSignal(checkpoint)
    stop.attach(trainer)
    for iteration, kind in sent.get(rank, []):
        _send_at(trainer, iteration, kind)
    terminated = []
    trainer.add_event_handler(Events.TERMINATE, lambda engine: terminated.append(engine.state.iteration))
    trainer.run(range(EPOCH_LENGTH), max_epochs=MAX_EPOCHS)
    return stop.stopped_at, trainer.state.iteration, terminated, str(checkpoint.last_checkpoint)


def _train(rank, world_size):
    model, trainer, _ = _zero_job(rank)
    trainer.run(range(EPOCH_LENGTH), max_epochs=MAX_EPOCHS)
    return model.module.state_dict()


def _resume(rank, world_size, path):
    model, trainer, to_load = _zero_job(rank)
    torch.nn.init.zeros_(model.module[0].weight)  # nothing of this model's own survives the load
    Checkpoint.load_objects(to_load=to_load, checkpoint=path)
    resumed_at = trainer.state.iteration
    iterations = []
    trainer.add_event_handler(Events.ITERATION_STARTED, lambda engine: iterations.append(engine.state.iteration))
    trainer.run(range(EPOCH_LENGTH), max_epochs=MAX_EPOCHS)
    return resumed_at, iterations, model.module.state_dict()


def test_a_signal_on_one_rank_saves_every_rank_at_the_same_iteration_and_the_run_resumes_from_it(tmp_path):
    # SIGTERM on rank 1 after iteration 7 (epoch 2): noted there, read at boundary 8, which proposes 8 + 2
    results = run_ranks(_stopped_by_a_signal, 2, tmp_path / "run", {1: [(7, signal.SIGTERM)]})
    path = tmp_path / "run" / "checkpoint_10.pt"
    assert results == [(10, 10, [10], str(path))] * 2  # TERMINATE fired, long before 20 iterations
    assert os.listdir(tmp_path / "run") == ["checkpoint_10.pt"]
    verify_file(path)
    assert torch.load(path, weights_only=True)["trainer"]["iteration"] == 10

    resumed = run_ranks(_resume, 2, path)
    uninterrupted = run_ranks(_train, 2)
    for rank in range(2):
        resumed_at, iterations, model_state = resumed[rank]
        assert resumed_at == 10 and iterations == list(range(11, EPOCH_LENGTH * MAX_EPOCHS + 1))
        assert_state_equal(model_state, uninterrupted[rank])  # bitwise: the same steps from the same state


def test_a_run_stopped_mid_epoch_by_a_signal_resumes_at_the_next_batch_bitwise(tmp_path):
    """SIGUSR1 on rank 1 after iteration 11, in the second epoch of 10: saved and stopped at 14 with a resumable
    sampler and RandomState(trainer); the resumed run sees the batches and ends with the state of an uninterrupted
    one, dropout included."""
    uninterrupted = run_ranks(train, 2, tmp_path / "whole", "resumable")
    stopped = run_ranks(train, 2, tmp_path / "stopped", "resumable", 0, None, 11)
    assert [(rank["stopped_at"], rank["iteration"]) for rank in stopped] == [(14, 14)] * 2
    resumed = run_ranks(train, 2, tmp_path / "stopped", "resumable")
    assert_resumed_as_uninterrupted(stopped, resumed, uninterrupted)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_signals_on_both_ranks_agree_on_the_first_proposal(tmp_path, async_save):
    # rank 0's SIGUSR1, read at boundary 5, proposes 7 first; rank 1's SIGTERM, read at boundary 6, gets 7 too
    sent = {0: [(4, signal.SIGUSR1)], 1: [(5, signal.SIGTERM)]}
    results = run_ranks(_stopped_by_a_signal, 2, tmp_path, sent, async_save)
    assert results == [(7, 7, [7], str(tmp_path / "checkpoint_7.pt"))] * 2  # durable once the run ended
    verify_file(tmp_path / "checkpoint_7.pt")


def test_a_run_that_ends_before_the_target_saves_nothing(tmp_path):
    # read at boundary 19, the last but one: the target, 21, lies past the end of the run
    results = run_ranks(_stopped_by_a_signal, 2, tmp_path, {1: [(18, signal.SIGTERM)]})
    assert results == [(None, EPOCH_LENGTH * MAX_EPOCHS, [], "None")] * 2
    assert os.listdir(tmp_path) == []


def _alone(rank, world_size, dirname):
    model = tiny_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    trainer = _trainer(model, optimizer, rank)
    checkpoint = Checkpoint({"model": model, "optimizer": optimizer, "trainer": trainer}, DiskSaver(dirname))
    stop = SaveOnSignal(checkpoint, signals=[signal.SIGUSR1])
    stop.attach(trainer)
    _send_at(trainer, 3, signal.SIGUSR1)
    terminated = []
    trainer.add_event_handler(Events.TERMINATE, lambda engine: terminated.append(engine.state.iteration))
    trainer.run(range(EPOCH_LENGTH), max_epochs=MAX_EPOCHS)
    return stop.stopped_at, terminated, str(checkpoint.last_checkpoint)


@pytest.mark.parametrize("init", [False, True], ids=["no process group", "one rank"])
def test_alone_it_saves_at_the_boundary_after_the_signal(tmp_path, init):
    assert run_ranks(_alone, 1, tmp_path, init=init) == [(4, [4], str(tmp_path / "checkpoint_4.pt"))]
    assert torch.load(tmp_path / "checkpoint_4.pt", weights_only=True)["trainer"]["iteration"] == 4


class _SignallingSaver(DiskSaver):
    """Sends SIGTERM to its own process at the start of its first write, and in the middle of its second."""

    writes = 0

    def _dump(self, checkpoint, f, func):
        self.writes += 1
        if self.writes == 2:
            f.write(b"part of a checkpoint")
        os.kill(os.getpid(), signal.SIGTERM)
        if self.writes == 2:
            (self.directory / "survived").touch()
        super()._dump(checkpoint, f, func)


def _signalled_twice(dirname):
    torch.set_num_threads(1)
    model = tiny_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    trainer = _trainer(model, optimizer, 0)
    checkpoint = Checkpoint(
        {"model": model, "optimizer": optimizer, "trainer": trainer}, _SignallingSaver(dirname), n_saved=None
    )
    SaveOnSignal(checkpoint).attach(trainer)
    trainer.add_event_handler(Events.ITERATION_COMPLETED(once=2), checkpoint)
    trainer.run(range(EPOCH_LENGTH), max_epochs=MAX_EPOCHS)
    (dirname / "survived").touch()


def test_a_signal_during_a_save_lets_it_finish_and_a_second_one_exits_at_once(tmp_path):
    # The first SIGTERM comes during the save of iteration 2, which completes; SaveOnSignal then saves iteration 3,
    # and the second SIGTERM in the middle of that write ends the process by the signal's default action.
    process = multiprocessing.get_context("fork").Process(target=_signalled_twice, args=(tmp_path,))
    process.start()
    process.join(60)
    if process.is_alive():
        process.kill()
        process.join()
        pytest.fail("the process survived the second SIGTERM")
    assert process.exitcode == -signal.SIGTERM
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")] == ["checkpoint_2.pt"]
    verify_file(tmp_path / "checkpoint_2.pt")
    assert torch.load(tmp_path / "checkpoint_2.pt", weights_only=True)["trainer"]["iteration"] == 2


def _previous_handler(number, frame):
    raise AssertionError("the previous handler must not run while SaveOnSignal handles the signal")


def _handlers_come_back(rank, world_size, ending):
    signal.signal(signal.SIGTERM, _previous_handler)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    previous = [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)]

    def step(engine, _):
        if ending == "exception" and engine.state.iteration == 2:
            raise ValueError("boom")

    trainer = Engine(step)
    stop = SaveOnSignal(lambda engine: None)
    stop.attach(trainer)
    during = []

    @trainer.on(Events.ITERATION_COMPLETED(once=1))
    def look(_):
        during.append([signal.getsignal(s) == stop._note for s in (signal.SIGTERM, signal.SIGUSR1)])
        if ending == "signal":
            os.kill(os.getpid(), signal.SIGTERM)
        if ending == "detach":
            stop.detach()
            during.append([signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)] == previous)

    if ending == "exception":
        with pytest.raises(ValueError, match="boom"):
            trainer.run(range(3))
    else:
        trainer.run(range(3))
    after = [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)]
    return during, after == previous, stop.stopped_at, trainer.state.iteration


_ENDINGS = {  # what handled the signals in the run, then stopped_at and the last iteration
    "completed": ([[True, True]], None, 3),
    "signal": ([[True, True]], 2, 2),
    "exception": ([[True, True]], None, 2),
    "detach": ([[True, True], True], None, 3),
}


@pytest.mark.parametrize("ending", list(_ENDINGS))
def test_previous_handlers_come_back_when_the_run_ends(ending):
    during, stopped_at, iteration = _ENDINGS[ending]
    assert run_ranks(_handlers_come_back, 1, ending, init=False) == [(during, True, stopped_at, iteration)]


def test_attaching_outside_the_main_thread_is_a_clear_error():
    errors = []

    def attach():
        try:
            SaveOnSignal(lambda engine: None).attach(Engine(lambda e, b: None))
        except RuntimeError as error:
            errors.append(str(error))

    thread = threading.Thread(target=attach, name="worker")
    thread.start()
    thread.join()
    assert len(errors) == 1 and "main thread only" in errors[0] and "'worker'" in errors[0]


def _wait_for(path):
    deadline = time.monotonic() + 30
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.005)


def _drifted(rank, world_size, dirname):
    # No collective in the step: rank 1 runs ahead to iteration 5 before rank 0, at boundary 2, proposes 2 + 2.
    model = tiny_model()
    trainer = Engine(lambda engine, _: None)
    checkpoint = Checkpoint({"model": model, "trainer": trainer}, DiskSaver(dirname / "ckpt"))
    stop = SaveOnSignal(checkpoint)
    stop.attach(trainer)
    if rank == 0:

        @trainer.on(Events.ITERATION_COMPLETED(once=1))
        def signal_once_rank_1_is_ahead(_):
            _wait_for(dirname / "ahead")
            os.kill(os.getpid(), signal.SIGTERM)

        trainer.add_event_handler(Events.ITERATION_COMPLETED(once=2), lambda _: (dirname / "proposed").touch())
        trainer.run(range(EPOCH_LENGTH), max_epochs=MAX_EPOCHS)
        return stop.stopped_at

    @trainer.on(Events.ITERATION_STARTED(once=5))
    def wait_for_the_proposal(_):
        (dirname / "ahead").touch()
        _wait_for(dirname / "proposed")

    with pytest.raises(RuntimeError) as error:
        trainer.run(range(EPOCH_LENGTH), max_epochs=MAX_EPOCHS)
    return str(error.value), trainer.state.iteration


def test_a_rank_past_the_target_raises_instead_of_saving_another_iteration(tmp_path):
    stopped_at, (message, iteration) = run_ranks(_drifted, 2, tmp_path)
    assert stopped_at == 4
    assert iteration == 5
    assert "Rank 1 is at iteration 5, past iteration 4" in message and "rank 0 received SIGTERM" in message
    assert os.listdir(tmp_path / "ckpt") == ["checkpoint_4.pt"]  # saved by rank 0, the recipient, alone
