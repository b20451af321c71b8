"""What the formats share (:mod:`ignite_zero.storage.formats.base`): their CRC-32 is zlib's, to the bit, whatever the
size, start value or slicing, so that manifests written before and after stay comparable."""

import random
import zlib

import pytest
import torch

from ignite_zero.storage.formats.base import crc32

# both sides of the 5 KiB above which the GIL is released, and chunks DCP writes
SIZES = [0, 1, 3, 64, 5 * 1024, 5 * 1024 + 1, 65_537, 1 << 20, 3_000_001]


@pytest.mark.parametrize("size", SIZES)
def test_crc32_is_zlibs(size):
    data = random.Random(size).randbytes(size)
    assert crc32(data) == zlib.crc32(data)
    for start in (0, 1, 0xFFFFFFFF, 0x1234ABCD):
        assert crc32(data, start) == zlib.crc32(data, start)


def test_crc32_is_zlibs_incrementally():
    rng = random.Random(0)
    data = rng.randbytes(4_000_000)
    view = memoryview(data)
    crc, position = 0, 0
    while position < len(data):
        end = position + rng.choice([1, 7, 4096, 5 * 1024 + 3, 100_000, 1_500_000])
        crc = crc32(view[position:end], crc)
        position = end
    assert crc == zlib.crc32(data)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.uint8])
def test_crc32_of_tensor_memory(dtype):
    tensor = (torch.randn(1_000_003, generator=torch.Generator().manual_seed(0)) * 100).to(dtype)
    view = memoryview(tensor.view(torch.uint8).numpy())
    assert crc32(view) == zlib.crc32(view)
    assert crc32(view[1000:], crc32(view[:1000])) == zlib.crc32(view)
