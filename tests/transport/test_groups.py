"""The gloo group that carries host tensors (:mod:`ignite_zero.transport.groups`): the default group when it is
gloo, one cached dedicated group when it is not."""

from datetime import timedelta

import pytest
import torch.distributed as dist
from launcher import run_ranks
from transported import assert_same, edge_case_object

from ignite_zero.transport import gather_to
from ignite_zero.transport.groups import cpu_group


def _test_cpu_group(rank: int, world_size: int) -> None:
    assert cpu_group() is dist.group.WORLD
    real = dist.get_backend_config

    def as_if_nccl(group: dist.ProcessGroup | None = None) -> str:
        return "cuda:nccl" if group in (None, dist.group.WORLD) else real(group)

    dist.get_backend_config = as_if_nccl
    try:
        with pytest.raises(ValueError, match="pass `cpu_group\\(group\\)`"):
            gather_to({}, 0)
        group = cpu_group(timeout=timedelta(seconds=20))
        assert group is not dist.group.WORLD and cpu_group() is group
        assert real(group) == "cpu:gloo,cuda:gloo"
        result = gather_to(edge_case_object(rank), 1, group)
        if rank == 1:
            assert_same(result[0], edge_case_object(0))
    finally:
        dist.get_backend_config = real


@pytest.mark.distributed
def test_cpu_group() -> None:
    """Gloo default group: reused. NCCL default group (simulated): one cached dedicated gloo group."""
    run_ranks(_test_cpu_group, 2)
