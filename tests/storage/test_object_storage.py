"""Checkpoints on object storage, against moto's S3 server on 127.0.0.1 (see conftest.py): both modes, n_saved,
loads on 2, 3 and 1 ranks, ranged reads, corrupt and truncated objects, interrupted saves, faults and bad input."""

import io
import os
import signal
import subprocess
import sys

import pytest
import s3fs
import torch
from ignite.engine import Engine, Events
from launcher import run_ranks
from training import (
    assert_state_equal,
    mixed_objects,
    mixed_twin,
    shard,
    small_net,
    tiny_model,
    train_step,
    zero_adam,
)

from ignite_zero import (
    Checkpoint,
    DiskSaver,
    IntegrityError,
    RankFailureError,
    ShardedSaver,
    _compat,
    cli,
    find_latest,
)
from ignite_zero.storage.formats import directory as sharded
from ignite_zero.storage.formats.file_trailer import SealingStream
from ignite_zero.storage.places import RemotePlace, StorageError

pytestmark = pytest.mark.distributed

SAVERS = {"consolidated": DiskSaver, "sharded": ShardedSaver}


def _client(options):
    return s3fs.S3FileSystem(skip_instance_cache=True, **options)


def _key(url):
    return url.removeprefix("s3://")


def _save_mixed(rank, world_size, url, options, mode):
    objects = mixed_objects("fsdp2", rank)
    saver = SAVERS[mode](url, storage_options=options, require_empty=False)
    checkpoint = Checkpoint(objects, saver, n_saved=2)
    objects["trainer"].add_event_handler(Events.EPOCH_COMPLETED, checkpoint)
    objects["trainer"].run(range(1), max_epochs=4)
    side_optimizer = objects["side_optimizer"]
    side_optimizer.consolidate_state_dict(to=0)
    return saver.list(), str(checkpoint.last_checkpoint), side_optimizer.state_dict() if rank == 0 else None


@pytest.fixture(scope="module", params=list(SAVERS))
def saved(request, s3_endpoint):
    """A run of 4 iterations on 2 ranks, FSDP2 and ZeRO among its objects, saved every iteration with n_saved=2."""
    mode = request.param
    options = {"endpoint_url": s3_endpoint}
    bucket = f"saved-{mode}"
    _client(options).mkdir(bucket)
    url = f"s3://{bucket}/run"
    results = run_ranks(_save_mixed, 2, url, options, mode)
    return mode, url, options, results


def test_saves_keep_n_saved_and_list_committed_checkpoints_only(saved):
    mode, url, options, results = saved
    ext = "pt" if mode == "consolidated" else "dcp"
    names = [f"checkpoint_3.{ext}", f"checkpoint_4.{ext}"]
    for listed, last, _ in results:
        assert listed == names and last == f"{url}/checkpoint_4.{ext}"
    present = sorted(path.rsplit("/", 1)[-1] for path in _client(options).ls(_key(url)))
    assert present == names  # nothing temporary left, the older checkpoints removed
    if mode == "sharded":
        files = {path.rsplit("/", 1)[-1] for path in _client(options).ls(f"{_key(url)}/{names[-1]}")}
        assert {".metadata", "ignite_zero.json"} <= files and not any(name.startswith(".ignite_zero") for name in files)


def _load(rank, world_size, url, options, directory):
    objects = mixed_objects("fsdp2", rank, seed=5)
    Checkpoint.load_objects(objects, url, storage_options=options)
    restored = {
        "model": objects["model"],
        "optimizer": objects["optimizer"],
        "side_optimizer": objects["side_optimizer"],
    }
    Checkpoint(restored, DiskSaver(directory))(Engine(lambda e, b: None))  # gathered again, to compare
    return objects["trainer"].state.iteration, objects["lr_scheduler"].last_epoch


@pytest.mark.parametrize("world_size", [2, 3])
def test_loads_on_any_number_of_ranks(saved, world_size, tmp_path):
    _, url, options, results = saved
    last, side_optimizer_state = results[0][1], results[0][2]
    assert run_ranks(_load, world_size, last, options, tmp_path) == [(4, 4)] * world_size
    state = torch.load(tmp_path / "checkpoint_0.pt", weights_only=True)
    twin, twin_optimizer = mixed_twin()
    torch.testing.assert_close(dict(state["model"]), dict(twin.state_dict()))
    names = [name for name, _ in twin.named_parameters()]
    for index, name in enumerate(names):
        torch.testing.assert_close(state["optimizer"]["state"][name], twin_optimizer.state_dict()["state"][index])
    assert_state_equal(state["side_optimizer"], side_optimizer_state)


def test_loads_into_plain_objects_in_one_process(saved):
    _, _, options, results = saved
    model = small_net()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.5)
    side = tiny_model(seed=3)
    side_optimizer = torch.optim.Adam(side.parameters())
    to_load = {"model": model, "optimizer": optimizer, "side_model": side, "side_optimizer": side_optimizer}
    Checkpoint.load_objects(to_load, results[0][1], storage_options=options)
    twin, twin_optimizer = mixed_twin()
    torch.testing.assert_close(model.state_dict(), twin.state_dict())
    torch.testing.assert_close(optimizer.state_dict(), twin_optimizer.state_dict())
    assert_state_equal(side_optimizer.state_dict(), results[0][2])


def test_find_latest_and_load_latest_on_a_url(saved):
    mode, url, options, results = saved
    assert find_latest(url, storage_options=options) == results[0][1]
    model = small_net()
    handler = Checkpoint({"model": model}, SAVERS[mode](url, storage_options=options, require_empty=False), n_saved=2)
    # a handler of other objects finds the same checkpoints; loading just the model from them works in one process
    assert handler.load_latest({"model": model}) == results[0][1]
    torch.testing.assert_close(model.state_dict(), mixed_twin()[0].state_dict())


def test_the_command_line_takes_urls(saved, capsys, monkeypatch):
    mode, url, options, results = saved
    if mode != "sharded":
        pytest.skip("one run covers both formats: the sharded checkpoint, and the file consolidated from it")
    option = ["--storage-option", f"endpoint_url={options['endpoint_url']}"]
    # the option, not the environment, must count
    env = {**os.environ, "AWS_ENDPOINT_URL": "http://127.0.0.1:9"}
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    command = [sys.executable, "-m", "ignite_zero", "verify", results[0][1], *option]
    verified = subprocess.run(command, env=env, capture_output=True)  # one real process; the rest in this one
    assert verified.returncode == 0 and b"sizes and CRC-32 match the manifest" in verified.stdout, verified.stderr
    target = f"{url}-consolidated/checkpoint_4.pt"
    assert cli.main(["consolidate", results[0][1], target, *option]) == 0
    assert cli.main(["inspect", target, *option]) == 0
    shown = capsys.readouterr().out
    assert "model: " in shown and "side_optimizer: " in shown
    assert cli.main(["verify", target, *option]) == 0
    assert cli.main(["verify", f"{url}/checkpoint_9.pt", *option]) == 1
    assert "does not exist" in capsys.readouterr().err
    model = small_net()
    Checkpoint.load_objects({"model": model}, target, storage_options=options)
    torch.testing.assert_close(model.state_dict(), mixed_twin()[0].state_dict())


def _big_zero(rank, world_size, url, options):
    """A ZeRO run whose optimizer state is most of the file; each rank then loads, counting what it reads."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)])
    optimizer = zero_adam(model)
    model(torch.randn(4, 256)).sum().backward()
    optimizer.step()
    checkpoint = Checkpoint({"model": model, "optimizer": optimizer}, DiskSaver(url, storage_options=options))
    checkpoint(Engine(lambda e, b: None))

    def local_state(zero):  # this rank's partition of the optimizer state, by parameter
        return [zero.optim.state[p]["exp_avg"].clone() for group in zero.optim.param_groups for p in group["params"]]

    expected = local_state(optimizer)
    read = []
    real_open = RemotePlace.open

    def counting_open(self, name, block_size=8 << 20):
        stream = real_open(self, name, block_size)
        real_read = stream.read

        def read_counted(length=-1):
            data = real_read(length)
            read.append(len(data))
            return data

        stream.read = read_counted
        return stream

    RemotePlace.open = counting_open
    torch.manual_seed(1)
    fresh = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)])
    fresh_optimizer = zero_adam(fresh)
    Checkpoint.load_objects(
        {"model": fresh, "optimizer": fresh_optimizer}, checkpoint.last_checkpoint, storage_options=options
    )
    RemotePlace.open = real_open
    restored = local_state(fresh_optimizer)
    assert len(restored) == len(expected) and all(torch.equal(a, b) for a, b in zip(restored, expected))
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    return sum(read), RemotePlace(url, options).size(checkpoint.last_checkpoint.rsplit("/", 1)[-1])


def test_each_rank_reads_only_what_its_objects_need(bucket, storage_options):
    results = run_ranks(_big_zero, 3, f"{bucket}/run", storage_options)
    for read, size in results:
        # the model whole (a third of the file), and this rank's third of the optimizer state (two thirds)
        assert read < 0.7 * size, (read, size)


def _wide_net(seed):
    """Shaped like ``small_net`` (two FSDP units), with tensors of 2.5 MB: many blocks each, not divisible by 3."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(600, 1031),
        torch.nn.ReLU(),
        torch.nn.Sequential(torch.nn.Linear(1031, 601), torch.nn.Linear(601, 3)),
    )


def _fsdp_trained(kind, seed):
    model = shard(_wide_net(seed), kind)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 600, generator=torch.Generator().manual_seed(0))).sum().backward()
    optimizer.step()
    return model, optimizer


def _downloads():
    """Count the bytes this process downloads from the store: every ranged GET of every file opened."""
    fetched = []
    real_fetch = s3fs.core.S3File._fetch_range

    def counting_fetch(self, start, end):
        data = real_fetch(self, start, end)
        fetched.append(len(data))
        return data

    s3fs.core.S3File._fetch_range = counting_fetch
    return fetched


def _save_fsdp_then_load(rank, world_size, url, options, kind, directory):
    model, optimizer = _fsdp_trained(kind, seed=0)
    saver = DiskSaver(url, storage_options=options, require_empty=False)
    checkpoint = Checkpoint({"model": model, "optimizer": optimizer}, saver)
    checkpoint(Engine(lambda e, b: None))
    fresh, fresh_optimizer = _fsdp_trained(kind, seed=1)
    fetched = _downloads()
    Checkpoint.load_objects(
        {"model": fresh, "optimizer": fresh_optimizer}, checkpoint.last_checkpoint, storage_options=options
    )
    read = sum(fetched)
    Checkpoint({"model": fresh, "optimizer": fresh_optimizer}, DiskSaver(directory))(Engine(lambda e, b: None))
    return read, checkpoint.last_checkpoint


@pytest.mark.parametrize("kind", ["fsdp1", "fsdp2"])
def test_fsdp_ranks_download_their_shards_of_a_file(bucket, storage_options, kind, tmp_path):
    results = run_ranks(_save_fsdp_then_load, 3, f"{bucket}/run", storage_options, kind, tmp_path)
    url = results[0][1]
    saved = torch.load(io.BytesIO(_client(storage_options).cat_file(_key(url))), weights_only=True)
    size = _client(storage_options).size(_key(url))
    for read, _ in results:
        # a third of every tensor; beyond each end of each part at most a block of 64 KiB and 64 KiB read ahead; the
        # pickle, and each of 24 record headers with 64 KiB read ahead: 0.39-0.46 of the file, measured
        assert read < 0.5 * size, (read, size)
    reloaded = torch.load(tmp_path / "checkpoint_0.pt", weights_only=True)  # gathered again from what was loaded
    assert_state_equal(reloaded, saved)


def _load_corrupt(rank, world_size, url, options):
    model, optimizer = _fsdp_trained("fsdp2", seed=1)
    with pytest.raises(RankFailureError) as raised:
        Checkpoint.load_objects({"model": model, "optimizer": optimizer}, url, storage_options=options)
    return str(raised.value)


def test_a_corrupt_block_in_a_part_is_found_by_the_rank_that_reads_it(bucket, storage_options, tmp_path):
    url = run_ranks(_save_fsdp_then_load, 2, f"{bucket}/run", storage_options, "fsdp2", tmp_path)[0][1]
    client = _client(storage_options)
    data = bytearray(client.cat_file(_key(url)))
    # the last quarter of the largest tensor: rank 1's rows only
    loaded = torch.load(io.BytesIO(data), map_location="meta", weights_only=True)
    weight = loaded["model"]["2.0.weight"]
    offset = _compat.storage_offset_in_file(weight.untyped_storage())
    data[offset + weight.untyped_storage().nbytes() * 3 // 4] ^= 0xFF
    client.pipe_file(_key(url), bytes(data))
    rank_0, rank_1 = run_ranks(_load_corrupt, 2, url, storage_options)
    assert rank_0 == rank_1 and "rank 1: IntegrityError" in rank_1 and "rank 0:" not in rank_1.split("ranks:", 1)[1]
    assert "of record" in rank_1 and "is corrupt" in rank_1 and _key(url) in rank_1


def _train_and_save(rank, world_size, url, options, mode, steps):
    model = tiny_model()
    optimizer = zero_adam(model)
    trainer = Engine(lambda engine, _: train_step(model, optimizer, rank, engine.state.iteration))
    saver = SAVERS[mode](url, storage_options=options, require_empty=False)
    checkpoint = Checkpoint({"model": model, "optimizer": optimizer}, saver, n_saved=2)
    trainer.add_event_handler(Events.ITERATION_COMPLETED, checkpoint)
    trainer.run(range(steps), max_epochs=1)
    return saver.list()


def _engine_at(iteration):
    engine = Engine(lambda e, b: None)
    engine.state.iteration = iteration
    return engine


def _large_objects():
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 4096)  # 16 MiB of weights: an upload in several 5 MiB parts
    return {"model": model, "optimizer": zero_adam(model)}


def _killed_mid_upload(rank, world_size, url, options, mode):
    objects = _large_objects() if mode == "consolidated" else {"model": tiny_model()}
    if rank == 0 and mode == "consolidated":  # the writer dies past the first part of the multipart upload
        real_write = SealingStream.write

        def write(self, data):
            if self._position > (6 << 20):
                os.kill(os.getpid(), signal.SIGKILL)
            return real_write(self, data)

        SealingStream.write = write
    if rank == 0 and mode == "sharded":  # the writer dies after every rank's files, before the manifest
        sharded.seal = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
    if mode == "sharded":
        objects["optimizer"] = zero_adam(objects["model"])
    handler = Checkpoint(objects, SAVERS[mode](url, storage_options=options, require_empty=False), sync_timeout=5)
    with pytest.raises(Exception, match=r"waiting for ranks \[0\]"):
        handler(_engine_at(9))


@pytest.mark.parametrize("mode", list(SAVERS))
def test_a_rank_killed_during_an_upload_loses_nothing(bucket, storage_options, mode):
    url = f"{bucket}/run"
    options = {**storage_options, "default_block_size": 5 << 20}  # multipart uploads of 5 MiB parts
    run_ranks(_train_and_save, 2, url, options, mode, 2)
    committed = find_latest(url, storage_options=options)
    assert committed is not None
    run_ranks(_killed_mid_upload, 2, url, options, mode, killed=[0], timeout=60)
    client = _client(storage_options)
    left = client.call_s3("list_multipart_uploads", Bucket=_key(bucket)).get("Uploads", [])
    present = sorted(path.rsplit("/", 1)[-1] for path in client.ls(_key(url), refresh=True))
    ext = "pt" if mode == "consolidated" else "dcp"
    if mode == "consolidated":
        assert len(left) == 1 and present == [f"checkpoint_1.{ext}", f"checkpoint_2.{ext}"]
    else:
        assert present == [f"checkpoint_1.{ext}", f"checkpoint_2.{ext}", f"checkpoint_9.{ext}"]
        with pytest.raises(IntegrityError, match=r"checkpoint_9.dcp is not a complete checkpoint: it has no "):
            Checkpoint.load_objects({"model": tiny_model()}, f"{url}/checkpoint_9.dcp", storage_options=options)
    # the earlier checkpoint is intact and still the latest: nothing uncommitted is taken for a checkpoint
    assert find_latest(url, storage_options=options) == committed
    assert SAVERS[mode](url, storage_options=options, require_empty=False).list() == [
        f"checkpoint_1.{ext}",
        f"checkpoint_2.{ext}",
    ]
    Checkpoint.load_objects({"model": tiny_model(seed=9)}, committed, storage_options=options)
    # the next save removes what the interrupted one left
    run_ranks(_train_and_save, 2, url, options, mode, 3)
    present = sorted(path.rsplit("/", 1)[-1] for path in client.ls(_key(url), refresh=True))
    assert present == [f"checkpoint_2.{ext}", f"checkpoint_3.{ext}"]
    assert client.call_s3("list_multipart_uploads", Bucket=_key(bucket)).get("Uploads", []) == []


def _save_with_server_error(rank, world_size, url, options):
    objects = _large_objects()
    if rank == 0:  # a server error in the middle of the upload: every part after the first is refused
        real_upload = s3fs.core.S3File._upload_chunk
        parts = []

        def upload(self, final=False):
            parts.append(final)
            if len(parts) > 1:
                raise OSError("An error occurred (InternalError) when calling the UploadPart operation (500)")
            return real_upload(self, final)

        s3fs.core.S3File._upload_chunk = upload
    handler = Checkpoint(objects, DiskSaver(url, storage_options=options, require_empty=False))
    with pytest.raises(RankFailureError) as raised:
        handler(_engine_at(9))
    return str(raised.value)


def test_a_server_error_mid_write_is_an_error_on_every_rank_and_loses_nothing(bucket, storage_options):
    url = f"{bucket}/run"
    options = {**storage_options, "default_block_size": 5 << 20}
    run_ranks(_train_and_save, 2, url, options, "consolidated", 2)
    committed = find_latest(url, storage_options=options)
    for message in run_ranks(_save_with_server_error, 2, url, options):
        assert "InternalError" in message and f"{url}/checkpoint_9.pt" in message, message
    assert find_latest(url, storage_options=options) == committed
    present = sorted(path.rsplit("/", 1)[-1] for path in _client(storage_options).ls(_key(url), refresh=True))
    assert present == ["checkpoint_1.pt", "checkpoint_2.pt"]  # no temporary left either


def test_corrupt_and_truncated_objects_are_refused_and_skipped(bucket, storage_options):
    url = f"{bucket}/run"
    run_ranks(_train_and_save, 2, url, storage_options, "consolidated", 3)
    handler_names = ["checkpoint_2.pt", "checkpoint_3.pt"]
    client = _client(storage_options)
    newest, second = f"{_key(url)}/{handler_names[1]}", f"{_key(url)}/{handler_names[0]}"
    data = bytearray(client.cat_file(newest))
    data[len(data) // 3] ^= 0xFF  # inside a tensor record
    client.pipe_file(newest, bytes(data))
    with pytest.raises(IntegrityError, match=rf"s3://{newest}.*corrupt"):
        Checkpoint.load_objects({"model": tiny_model()}, f"s3://{newest}", storage_options=storage_options)
    client.pipe_file(second, client.cat_file(second)[:-100])
    with pytest.raises(IntegrityError, match=rf"s3://{second}"):
        Checkpoint.load_objects({"model": tiny_model()}, f"s3://{second}", storage_options=storage_options)
    assert find_latest(url, storage_options=storage_options) is None  # n_saved=2: both kept files are damaged


def test_bad_places_are_clear_errors(bucket, storage_options):
    model = tiny_model()
    with pytest.raises(FileNotFoundError, match=r"Bucket 'no-such-bucket' of s3://no-such-bucket/run does not exist"):
        Checkpoint({"model": model}, DiskSaver("s3://no-such-bucket/run", storage_options=storage_options))(
            _engine_at(1)
        )
    with pytest.raises(ValueError, match=r"nosuch://place/run: Protocol not known"):
        DiskSaver("nosuch://place/run")
    with pytest.raises(ValueError, match="are for URLs"):
        DiskSaver("local/run", storage_options=storage_options)
    unreachable = {
        "endpoint_url": "http://127.0.0.1:9",
        "config_kwargs": {"connect_timeout": 1, "retries": {"max_attempts": 1}},
    }
    with pytest.raises(StorageError, match=rf"{bucket}/run failed: .*endpoint_url"):
        Checkpoint({"model": model}, DiskSaver(f"{bucket}/run", storage_options=unreachable))(_engine_at(1))


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_memory_and_file_urls_in_both_modes(tmp_path, async_save):
    model = tiny_model()
    for saver, ext in ((DiskSaver, "pt"), (ShardedSaver, "dcp")):
        for url in (f"memory://ignite-zero-test/{ext}{async_save}", f"file://{tmp_path}/{ext}"):
            handler = Checkpoint({"model": model}, saver(url), n_saved=2, async_save=async_save)
            for step in (1, 2, 3):
                handler(_engine_at(step))
            handler.wait()
            assert handler.save_handler.list() == [f"model_2.{ext}", f"model_3.{ext}"]
            fresh = tiny_model(seed=4)
            Checkpoint.load_objects({"model": fresh}, handler.last_checkpoint)
            assert_state_equal(fresh.state_dict(), model.state_dict())
            assert find_latest(url) == str(handler.last_checkpoint)
        assert handler.last_checkpoint == tmp_path / ext / f"model_3.{ext}"  # a file:// URL is a local path


def test_export_reads_a_url_one_tensor_at_a_time(saved, tmp_path):
    from safetensors.torch import load_file

    from ignite_zero import export

    _, _, options, results = saved
    files = export(results[0][1], tmp_path / "hf", storage_options=options)
    assert [path.name for path in files] == ["model.safetensors"]
    exported = load_file(files[0])
    twin = mixed_twin()[0].state_dict()
    assert sorted(exported) == sorted(twin)
    torch.testing.assert_close(exported, dict(twin))
