"""Several hosts on one machine, for tests of what node-local storage does to a job of several hosts.

Each host is a Linux mount and UTS namespace (``unshare --mount --uts --fork``, as root): it has a hostname of its
own, and a node-local disk of its own (a directory of the test's) bind-mounted at one common path, so that every host
sees a different directory at that same path, as with local NVMe under ``/local`` on a cluster. The network stays
shared: the ranks of all hosts meet in one gloo process group over 127.0.0.1. Each host's ranks are started by a
launcher in that host: ignite's ``idist.Parallel(nnodes=..., node_rank=...)``, or ``torchrun --nnodes ...``.

Where ``unshare`` or ``mount`` is refused (not root, or no namespaces in this sandbox), :func:`refusal` says why and
the tests skip with that reason.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Host", "refusal", "start_hosts", "wait_for"]

SCENARIOS = Path(__file__).with_name("host_scenarios.py")


@dataclass
class Host:
    """One simulated host: its process (the session of its launcher and ranks) and its node-local disk."""

    node_rank: int
    disk: Path
    process: subprocess.Popen

    def kill(self) -> None:
        """Lose the host: every process of it, launcher and ranks, killed at once."""
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def output(self) -> str:
        out, _ = self.process.communicate()
        return out.decode(errors="replace")


def refusal() -> str | None:
    """Why hosts cannot be simulated here, ``None`` if they can."""
    if os.geteuid() != 0:
        return "simulated hosts need root, for unshare --mount and mount --bind"
    probe = subprocess.run(
        ["unshare", "--mount", "--uts", "--fork", "sh", "-c", "hostname ignite-zero-probe && mount -t tmpfs t /mnt"],
        capture_output=True,
    )
    if probe.returncode != 0:
        return f"unshare --mount --uts is refused here: {probe.stderr.decode().strip()}"
    return None


def start_hosts(
    scenario: str, workdir: Path, *, nnodes: int = 2, nproc_per_node: int = 2, port: int, launcher: str = "idist"
) -> list[Host]:
    """Start ``nnodes`` hosts that run ``scenario`` of ``host_scenarios.py`` on ``nproc_per_node`` ranks each.

    Every host mounts its disk ``workdir/disk-N`` at ``workdir/node-local``; the ranks leave their results in
    ``workdir`` itself, which every host shares.

    Args:
        scenario: name of a function of ``host_scenarios.py``.
        workdir: the test's directory.
        nnodes: hosts.
        nproc_per_node: ranks of each host.
        port: the free port of rank 0's store, on 127.0.0.1.
        launcher: ``"idist"`` (``idist.Parallel`` with ``nnodes`` and ``node_rank``) or ``"torchrun"``.
    """
    node_local = workdir / "node-local"
    node_local.mkdir(exist_ok=True)
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1"}
    hosts = []
    for node_rank in range(nnodes):
        disk = workdir / f"disk-{node_rank}"
        disk.mkdir(exist_ok=True)
        arguments = [scenario, str(workdir), str(node_local), *map(str, (nnodes, nproc_per_node, node_rank, port))]
        if launcher == "torchrun":
            command = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nnodes={nnodes}",
                f"--nproc-per-node={nproc_per_node}",
                f"--node-rank={node_rank}",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                str(SCENARIOS),
                *arguments,
            ]
        else:
            command = [sys.executable, str(SCENARIOS), *arguments]
        # in the host's namespaces: its name, then its disk at the common path, then its launcher
        inside = 'hostname "$1" && mount --bind "$2" "$3" && shift 3 && exec "$@"'
        process = subprocess.Popen(
            ["unshare", "--mount", "--uts", "--fork", "sh", "-c", inside, "sh", f"host-{node_rank}", str(disk)]
            + [str(node_local), *command],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        hosts.append(Host(node_rank, disk, process))
    return hosts


def wait_for(hosts: Sequence[Host], timeout: float) -> list[str]:
    """Wait for every host to end, killing all of them at the deadline; return each host's output.

    Raises:
        AssertionError: a host failed or ran past ``timeout``; the message holds every host's output.
    """
    deadline = time.monotonic() + timeout
    for host in hosts:
        try:
            host.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            break
    late = [host.node_rank for host in hosts if host.process.poll() is None]
    for host in hosts:
        if host.process.poll() is None:
            host.kill()
    outputs = [host.output() for host in hosts]
    failed = [host.node_rank for host in hosts if host.process.returncode != 0]
    if late or failed:
        listing = "\n".join(
            f"--- host {h.node_rank}, exit {h.process.returncode}:\n{out}" for h, out in zip(hosts, outputs)
        )
        raise AssertionError(f"hosts {late} ran past {timeout:g} s, hosts {failed} failed:\n{listing}")
    return outputs
