"""The examples run as users run them."""

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from training import assert_state_equal

EXAMPLES = Path(__file__).parents[2] / "examples"

pytestmark = pytest.mark.distributed


def _main_example(output_dir: Path, port: int) -> list[str]:
    """The main example's command, on a port of its own: tests run side by side, and ignite's default is one port."""
    script = str(EXAMPLES / "train_zero.py")
    return [
        sys.executable,
        script,
        "--output-dir",
        str(output_dir),
        "--start-method",
        "fork",
        "--master-port",
        str(port),
    ]


def test_main_example_trains_on_two_ranks_and_resumes_on_three(tmp_path, free_port):
    command = _main_example(tmp_path, free_port)
    result = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-5000:]
    assert "[2 ranks] epoch 3: loss" in result.stdout
    assert (
        "[3 ranks] restored checkpoint_48.pt: epoch 3, iteration 48; optimizer state of 6 parameters matches: True"
        in (result.stdout)
    )
    assert "[3 ranks] epoch 4: loss" in result.stdout and "saved" in result.stdout
    # the resumed run went on checkpointing, and on removing the oldest files
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_48.pt", "checkpoint_64.pt"]


def test_main_example_resumes_automatically_from_the_newest_checkpoint(tmp_path, free_port):
    command = _main_example(tmp_path, free_port)
    command += ["--resume", "auto", "--resume-nproc-per-node", "0"]
    first = subprocess.run([*command, "--epochs", "2"], capture_output=True, text=True, timeout=240)
    assert first.returncode == 0, first.stderr[-5000:]
    assert "[2 ranks] no checkpoint yet" in first.stdout and "[2 ranks] epoch 2: loss" in first.stdout
    again = subprocess.run([*command, "--epochs", "3"], capture_output=True, text=True, timeout=240)  # a restart
    assert again.returncode == 0, again.stderr[-5000:]
    assert f"[2 ranks] resumed from {tmp_path / 'checkpoint_32.pt'}" in again.stdout
    assert "epoch 1:" not in again.stdout and "[2 ranks] epoch 3: loss" in again.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_32.pt", "checkpoint_48.pt"]


def _example(*arguments: str, **popen: Any) -> subprocess.Popen:
    """An example script started as a user starts it, its output read as text."""
    command = [sys.executable, *arguments]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)


def _finish(*processes: subprocess.Popen, timeout: float = 240) -> list[str]:
    """Wait for every process; its output, or an assertion naming the one that failed, with every output."""
    outputs = []
    for process in processes:
        try:
            outputs.append(process.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for other in processes:
                other.kill()
            raise
    failed = [(process.args, process.returncode) for process in processes if process.returncode != 0]
    assert not failed, f"{failed}:\n" + "\n---\n".join(output[-3000:] for output in outputs)
    return outputs


def test_fsdp2_example_resumes_and_exports_the_last_checkpoint(tmp_path, free_port):
    """Two runs: the second resumes from the first's checkpoint; each exports its last one as safetensors, equal to
    the model in the checkpoint."""
    script = str(EXAMPLES / "train_fsdp2.py")
    common = [
        "--output-dir",
        str(tmp_path / "ckpt"),
        "--export-dir",
        str(tmp_path / "export"),
        "--start-method",
        "fork",
        "--master-port",
        str(free_port),
    ]
    (first,) = _finish(_example(script, *common, "--epochs", "1"))
    assert "[2 ranks] no checkpoint yet" in first and "[2 ranks] epoch 1: loss" in first
    (second,) = _finish(_example(script, *common, "--epochs", "2"))
    assert f"[2 ranks] resumed from {tmp_path / 'ckpt' / 'checkpoint_16.pt'} at epoch 1" in second
    assert "epoch 1:" not in second and "[2 ranks] epoch 2: loss" in second
    exported = load_file(tmp_path / "export" / "checkpoint_32" / "model.safetensors")
    saved = torch.load(tmp_path / "ckpt" / "checkpoint_32.pt", weights_only=True)["model"]
    assert sorted(exported) == sorted(saved) == ["0.bias", "0.weight", "2.bias", "2.weight", "4.bias", "4.weight"]
    for name, tensor in saved.items():
        assert torch.equal(exported[name], tensor), name


def test_multinode_example_on_two_hosts_under_idist_then_torchrun(tmp_path, free_port):
    """Two hosts of one rank each, over gloo on 127.0.0.1, sharing the checkpoint directory: launched by
    ``idist.Parallel(nnodes=2, node_rank=...)``, they save a sharded checkpoint; launched again by ``torchrun
    --nnodes 2``, they resume from it and save the next."""
    script, shared = str(EXAMPLES / "multinode.py"), str(tmp_path / "shared")
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    hosts = [
        _example(
            script,
            "--nnodes",
            "2",
            "--node-rank",
            str(node),
            "--master-port",
            str(free_port),
            "--epochs",
            "1",
            "--output-dir",
            shared,
            "--start-method",
            "fork",
            env=env,
        )
        for node in (0, 1)
    ]
    first = _finish(*hosts)
    assert "[rank 0 on" in first[0] and "[rank 1 on" in first[1] and "no checkpoint yet" in first[1]
    assert "[2 ranks] epoch 1: saved" in first[0] and (tmp_path / "shared" / "checkpoint_4.dcp").is_dir()
    torchrun = ["-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"]
    torchrun += ["--master-addr", "127.0.0.1", "--master-port", str(free_port)]
    hosts = [
        _example(
            *torchrun,
            "--node-rank",
            str(node),
            script,
            "--nproc-per-node",
            "0",
            "--epochs",
            "2",
            "--output-dir",
            shared,
            env=env,
        )
        for node in (0, 1)
    ]
    second = _finish(*hosts)
    assert all(f"resumed from {tmp_path / 'shared' / 'checkpoint_4.dcp'}" in output for output in second)
    assert sorted(p.name for p in (tmp_path / "shared").iterdir()) == ["checkpoint_4.dcp", "checkpoint_8.dcp"]


def _srun_command(sbatch: Path) -> str:
    """The command that ``train.sbatch`` gives ``srun``, with its shell variables left for bash to expand."""
    lines = [line for line in sbatch.read_text().splitlines() if line.startswith("srun ")]
    assert len(lines) == 1, lines
    return lines[0].removeprefix("srun ")


def _port_of_a_slurm_job() -> tuple[str, int]:
    """A job id whose rendezvous port is free: ignite's idist takes port 15000 + the id's last 4 digits."""
    for job in range(1000, 10000, 97):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", 15000 + job))
            except OSError:
                continue
            return str(job), 15000 + job
    raise AssertionError("no free port in 16000-24999")


def _batches(*outputs: str) -> dict[tuple[str, str], str]:
    """``(rank, iteration)``: the digest of the batch that rank trained on, from ``train.py --log-batches``."""
    found = [re.findall(r"^rank (\d+) iteration (\d+): batch (\w+)$", output, re.MULTILINE) for output in outputs]
    return {(rank, iteration): digest for lines in found for rank, iteration, digest in lines}


def test_slurm_example_saves_on_usr1_mid_epoch_and_the_requeued_job_continues_at_the_next_batch(tmp_path):
    """What ``srun`` does, done here: the command of ``train.sbatch``'s srun line runs as 2 tasks with the variables
    SLURM gives them (``SLURM_PROCID``...), on one node named ``localhost``. SIGUSR1 to one task, as
    ``--signal=USR1@90`` sends near the time limit, a few iterations into the second epoch: every rank saves at one
    iteration and exits with the status that the script requeues on. Started again, as a requeued job is, the tasks
    resume from that checkpoint at the next batch: they train on the rest of the epoch's batches of an uninterrupted
    run, and end with its checkpoint, bitwise."""
    sbatch = EXAMPLES / "slurm" / "train.sbatch"
    assert {"#SBATCH --signal=USR1@90", "#SBATCH --requeue"} <= set(sbatch.read_text().splitlines())
    job, _ = _port_of_a_slurm_job()
    slurm = {"SLURM_JOB_ID": job, "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_NUM_NODES": "1"}
    env = {**os.environ, **slurm, "BACKEND": "gloo", "GLOO_SOCKET_IFNAME": "lo"}

    def tasks(epochs: int, checkpoints: Path) -> list[subprocess.Popen]:
        path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"  # `python` is this one
        variables = {**env, "PATH": path, "EPOCHS": str(epochs), "CHECKPOINTS": str(checkpoints)}
        return [
            subprocess.Popen(
                ["bash", "-c", _srun_command(sbatch) + " --log-batches"],
                cwd=EXAMPLES.parent,
                env={**variables, "SLURM_PROCID": str(task), "SLURM_LOCALID": str(task)},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for task in (0, 1)
        ]

    started = tasks(epochs=1000, checkpoints=tmp_path / "ckpt")
    read = []
    try:
        for line in started[0].stdout:  # rank 0 trains: then the signal, to the other task, in epoch 2
            read.append(line)
            if line.startswith("rank 0 iteration 70:"):
                started[1].send_signal(signal.SIGUSR1)
                break
        outputs = ["".join(read) + started[0].communicate(timeout=120)[0], started[1].communicate(timeout=120)[0]]
    finally:  # a signal that stopped nothing leaves 1000 epochs to run
        for task in started:
            task.kill()
    assert [task.returncode for task in started] == [3, 3], outputs
    saved = re.search(r"stopped by a signal: saved (\S+) at iteration (\d+), epoch (\d+)", outputs[0])
    assert saved and Path(saved[1]).name == f"checkpoint_{saved[2]}.pt", outputs[0]
    assert saved[3] == "2" and int(saved[2]) % 64, saved[0]  # 64 iterations an epoch: stopped in the middle

    resumed = _finish(*tasks(epochs=2, checkpoints=tmp_path / "ckpt"))  # the rest of the interrupted epoch
    assert f"resumed from {saved[1]} at iteration {saved[2]}" in resumed[0], resumed[0]
    assert "epoch 2: loss" in resumed[0] and "stopped by a signal" not in resumed[0]
    uninterrupted = _finish(*tasks(epochs=2, checkpoints=tmp_path / "whole"))
    assert _batches(*outputs, *resumed) == _batches(*uninterrupted)
    assert len(_batches(*uninterrupted)) == 2 * 2 * 64
    last = torch.load(tmp_path / "ckpt" / "checkpoint_128.pt", weights_only=True)
    assert_state_equal(last, torch.load(tmp_path / "whole" / "checkpoint_128.pt", weights_only=True))


def test_object_storage_example_saves_and_loads_both_modes(bucket, free_port):
    """Against moto's S3 server on 127.0.0.1, named by ``AWS_ENDPOINT_URL`` in the environment, as the script
    expects of any store."""
    script = str(EXAMPLES / "object_storage.py")
    (output,) = _finish(_example(script, f"{bucket}/run", "--start-method", "fork", "--master-port", str(free_port)))
    for mode, name in (("consolidated", "checkpoint_16.pt"), ("sharded", "checkpoint_16.dcp")):
        assert f"[2 ranks] {mode}: saved and loaded {bucket}/run/{mode}/{name}; state restored: True" in output
