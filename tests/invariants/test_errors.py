"""Every bad input gets an error that names the problem and the fix."""

import pytest
import torch
import torch.distributed as dist
from ignite.engine import Engine
from ignite.handlers import DiskSaver as IgniteDiskSaver
from launcher import run_ranks
from training import tiny_model, zero_adam

from ignite_zero import (
    Checkpoint,
    ConsolidateZeROHandler,
    DiskSaver,
    ModelCheckpoint,
    RankFailureError,
    ZeROState,
    find_latest,
)


def test_negative_recipient(tmp_path):
    with pytest.raises(ValueError, match="`consolidate_recipient_rank` should be a non-negative integer, got -1"):
        Checkpoint({"model": tiny_model()}, tmp_path, consolidate_recipient_rank=-1)


def test_recipient_outside_the_world(tmp_path):
    with pytest.raises(
        ValueError, match=r"Recipient rank 1 is outside the process group of 1 ranks; choose a rank in \[0, 1\)"
    ):
        Checkpoint({"model": tiny_model()}, tmp_path, consolidate_recipient_rank=1)


@pytest.mark.parametrize(
    "kwargs, saver_rank, message",
    [
        ({"save_on_rank": 1, "consolidate_recipient_rank": 0}, None, "save_on_rank=1"),
        ({"consolidate_recipient_rank": 0}, 1, "the save_handler's save_on_rank=1"),
        ({"save_on_rank": 0}, 1, "the save_handler's save_on_rank=1"),
    ],
)
def test_conflicting_ranks(tmp_path, kwargs, saver_rank, message):
    saver = DiskSaver(tmp_path, save_on_rank=saver_rank) if saver_rank is not None else tmp_path
    with pytest.raises(ValueError, match=rf"Conflicting writing ranks: .*{message}.*give one rank"):
        Checkpoint({"model": tiny_model()}, saver, **kwargs)


def test_ignite_disk_saver_rank_counts_as_given(tmp_path):
    with pytest.raises(ValueError, match="Conflicting writing ranks: consolidate_recipient_rank=0, the save_handler's"):
        Checkpoint({"model": tiny_model()}, IgniteDiskSaver(tmp_path, save_on_rank=1), consolidate_recipient_rank=0)


def test_object_without_state_dict(tmp_path):
    with pytest.raises(TypeError, match=r"<class 'int'> should have `state_dict` method: object \['data'\]\[1\]"):
        Checkpoint({"model": tiny_model(), "data": [tiny_model(), 2]}, tmp_path)
    with pytest.raises(TypeError, match=r"<class 'str'> should have `load_state_dict` method: object \['data'\]"):
        Checkpoint.load_objects({"data": "x"}, {"data": {}})


def test_file_names_escaping_the_directory(tmp_path):
    with pytest.raises(ValueError, match=r"'\.\./x' is not a plain file name.*Remove path separators"):
        Checkpoint({"model": tiny_model()}, tmp_path, filename_prefix="../x")
    handler = Checkpoint({"model": tiny_model()}, tmp_path / "d", score_function=lambda _: 1.0, score_name="a/b")
    with pytest.raises(ValueError, match=r"'model_a/b=1.0000.pt' is not a plain file name"):
        handler(Engine(lambda e, b: None))
    saver = DiskSaver(tmp_path / "e")
    with pytest.raises(ValueError, match="not a plain file name"):
        saver({}, "/etc/passwd")


def test_missing_entry_at_load(tmp_path):
    DiskSaver(tmp_path)({"model": tiny_model().state_dict(), "trainer": {}}, "c.pt")
    message = r"Key 'optimizer' from x is not found in y: .* for \['optimizer'\] \(it holds \['model', 'trainer'\]\)"
    with pytest.raises(ValueError, match=message):
        Checkpoint.load_objects(
            {"model": tiny_model(), "optimizer": torch.optim.SGD(tiny_model().parameters(), lr=1)}, tmp_path / "c.pt"
        )


def test_missing_checkpoint_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="c.pt does not exist on rank 0"):
        Checkpoint.load_objects({"model": tiny_model()}, tmp_path / "c.pt")


def test_bad_argument_types(tmp_path):
    with pytest.raises(TypeError, match="Argument checkpoint should be a string or a dictionary"):
        Checkpoint.load_objects({"model": tiny_model()}, 3)
    with pytest.raises(ValueError, match="`sync_timeout` should be a positive number of seconds"):
        Checkpoint({"model": tiny_model()}, tmp_path, sync_timeout=0)
    with pytest.raises(ValueError, match="Output of score_function should be a number, got Tensor"):
        Checkpoint({"model": tiny_model()}, tmp_path, score_function=lambda _: torch.tensor(1.0))(
            Engine(lambda e, b: None)
        )
    with pytest.raises(ValueError, match="`save_on_rank` should be a non-negative integer, got -2"):
        ModelCheckpoint(tmp_path, save_on_rank=-2)
    with pytest.raises(TypeError, match="save\\(\\) got an unexpected keyword argument 'compress'.* which takes"):
        DiskSaver(tmp_path / "kw", compress=True)({}, "c.pt")  # at the save, as ignite's; no file left behind
    assert list((tmp_path / "kw").iterdir()) == []
    with pytest.raises(ValueError, match="already present in the directory .* pass `require_empty=False`"):
        torch.save({}, tmp_path / "old.pt")
        DiskSaver(tmp_path, save_on_rank=0)


class _NoRecipient:
    def consolidate_state_dict(self, a, b):
        pass

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


class _Positional(_NoRecipient):
    def consolidate_state_dict(self, rank):
        self.rank = rank


def test_consolidate_handler_arguments():
    with pytest.raises(TypeError, match=r"Cannot tell how .*consolidate_state_dict\(a, b\) takes the recipient rank"):
        ConsolidateZeROHandler(_NoRecipient())
    with pytest.raises(TypeError, match="list has no `consolidate_state_dict` method: it is not a sharded optimizer"):
        ConsolidateZeROHandler([])
    with pytest.raises(ValueError, match="`call_every` should be a positive integer, got 0"):
        ConsolidateZeROHandler(_Positional(), call_every=0)
    with pytest.raises(ValueError, match="`recipient_rank` should be a non-negative integer, got -1"):
        ConsolidateZeROHandler(_Positional(), recipient_rank=-1)
    with pytest.raises(ValueError, match=r"`recipient_rank` is 3, outside the process group of 1 ranks"):
        ConsolidateZeROHandler(_Positional(), recipient_rank=3)


def _positional_signature(rank, world_size):
    optimizer = _Positional()
    optimizer.process_group = dist.group.WORLD
    ConsolidateZeROHandler(optimizer, recipient_rank=1)()
    return optimizer.rank


def test_consolidate_state_dict_with_a_single_positional_parameter():
    assert run_ranks(_positional_signature, 2) == [1, 1]


def _stale_process_group(rank, world_size, tmp_path):
    optimizer = zero_adam(tiny_model())
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=rank, world_size=world_size)
    with pytest.raises(RankFailureError, match="The process group of this ZeroRedundancyOptimizer is not part of"):
        Checkpoint({"optimizer": optimizer}, DiskSaver(tmp_path / "ckpt"))(Engine(lambda e, b: None))


def test_sharded_optimizer_on_a_destroyed_process_group(tmp_path):
    run_ranks(_stale_process_group, 2, tmp_path)


def test_adapter_for_another_recipient(tmp_path):
    optimizer = object.__new__(_Positional)
    with pytest.raises(ValueError, match="sends its state to rank 1, but the checkpoint is consolidated on rank 0"):
        Checkpoint({"optimizer": ZeROState(optimizer, recipient_rank=1)}, tmp_path)(Engine(lambda e, b: None))


def test_urls_of_unknown_protocols_are_clear_errors_never_local_directories(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for make in (
        lambda: DiskSaver("nosuch://bucket/run"),
        lambda: Checkpoint({"model": tiny_model()}, "nosuch://bucket/run"),
        lambda: Checkpoint.load_objects({"model": tiny_model()}, "nosuch://bucket/run/checkpoint_3.pt"),
        lambda: find_latest("nosuch://bucket/run"),
    ):
        with pytest.raises(ValueError, match=r"nosuch://bucket/run.*Protocol not known.*use a local path, or a URL"):
            make()
    assert list(tmp_path.iterdir()) == []  # no directory named "nosuch:"
    saver = DiskSaver(f"file://{tmp_path}/run")  # a file URL is a local path
    assert saver.dirname == tmp_path / "run"
