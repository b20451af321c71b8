"""The CRC-32 of sharded checkpoints is zlib's, to the bit: manifests written before and after stay comparable."""

from __future__ import annotations

import io
import random
import zlib

import pytest
import torch

from ignite_zero import sharded
from ignite_zero.storage.places import LocalPlace

# both sides of the 5 KiB above which the GIL is released, and chunks DCP writes
SIZES = [0, 1, 3, 64, 5 * 1024, 5 * 1024 + 1, 65_537, 1 << 20, 3_000_001]


@pytest.mark.parametrize("size", SIZES)
def test_crc32_is_zlibs(size):
    data = random.Random(size).randbytes(size)
    assert sharded.crc32(data) == zlib.crc32(data)
    for start in (0, 1, 0xFFFFFFFF, 0x1234ABCD):
        assert sharded.crc32(data, start) == zlib.crc32(data, start)


def test_crc32_is_zlibs_incrementally():
    rng = random.Random(0)
    data = rng.randbytes(4_000_000)
    view = memoryview(data)
    crc, position = 0, 0
    while position < len(data):
        end = position + rng.choice([1, 7, 4096, 5 * 1024 + 3, 100_000, 1_500_000])
        crc = sharded.crc32(view[position:end], crc)
        position = end
    assert crc == zlib.crc32(data)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.uint8])
def test_crc32_of_tensor_memory(dtype):
    tensor = (torch.randn(1_000_003, generator=torch.Generator().manual_seed(0)) * 100).to(dtype)
    view = memoryview(tensor.view(torch.uint8).numpy())
    assert sharded.crc32(view) == zlib.crc32(view)
    assert sharded.crc32(view[1000:], sharded.crc32(view[:1000])) == zlib.crc32(view)


def test_stream_and_file_checksums_are_zlibs(tmp_path):
    rng = random.Random(1)
    chunks = [rng.randbytes(rng.choice([0, 5, 8192, 700_000])) for _ in range(40)]
    target = io.BytesIO()
    stream = sharded._ChecksummingStream(target)
    for chunk in chunks:
        stream.write(memoryview(chunk))
    written = target.getvalue()
    assert (stream.size, stream.crc) == (len(written), zlib.crc32(written))
    (tmp_path / "file").write_bytes(written)
    assert sharded._file_crc(LocalPlace(tmp_path), "file") == zlib.crc32(written)
