"""What one host holds of a replicated checkpoint (:mod:`ignite_zero.storage.replicas.checking`): one check of its
directory against the manifest serves a load (what verifies here, what to fetch) and ``verify`` (the first problem)."""

import json
from pathlib import Path

import pytest

from ignite_zero.storage.formats import IntegrityError
from ignite_zero.storage.formats.base import crc32
from ignite_zero.storage.places import LocalPlace
from ignite_zero.storage.replicas import check_host_copy


def _host_copy(root: Path) -> LocalPlace:
    """One host's directory of a replicated checkpoint ``ckpt`` that lists three files: one intact, one corrupt, and
    one that lives on another host only."""
    directory = root / "ckpt"
    directory.mkdir()
    (directory / "__0_0.distcp").write_bytes(b"intact")
    (directory / "__1_0.distcp").write_bytes(b"rotted")
    files = {
        "__0_0.distcp": {"size": 6, "crc32": crc32(b"intact"), "records": []},
        "__1_0.distcp": {"size": 6, "crc32": crc32(b"before"), "records": []},
        "__2_0.distcp": {"size": 6, "crc32": crc32(b"remote"), "records": []},
    }
    keepers = {"__0_0.distcp": ["a", "b"], "__1_0.distcp": ["b", "a"], "__2_0.distcp": ["c", "b"]}
    manifest = {"format": "ignite_zero-sharded", "files": files, "replicas": 1, "hosts": ["a", "b", "c"]}
    (directory / "ignite_zero.json").write_text(json.dumps({**manifest, "keepers": keepers}))
    return LocalPlace(root)


def test_one_check_of_a_host_copy_serves_a_load_and_verify(tmp_path, caplog):
    place = _host_copy(tmp_path)
    copy = check_host_copy(place, "ckpt", host="a")  # a load: what verifies here, the rest fetched again
    assert copy is not None and copy.good == {"__0_0.distcp"} and copy.elsewhere == {"__2_0.distcp": ["c", "b"]}
    assert "__1_0.distcp is corrupt" in caplog.text
    sizes_only = check_host_copy(place, "ckpt", verify=False, host="a")
    assert sizes_only is not None and sizes_only.good == {"__0_0.distcp", "__1_0.distcp"}
    assert sizes_only.identity == copy.identity  # the manifest's, whatever the host holds
    with pytest.raises(IntegrityError, match=r"__1_0.distcp is corrupt \(CRC-32"):  # verify: the first problem
        check_host_copy(place, "ckpt", strict=True, host="a")
    (tmp_path / "ckpt" / "__1_0.distcp").unlink()
    with pytest.raises(IntegrityError, match=r"__1_0.distcp is missing, and this host \(a\) is one of those"):
        check_host_copy(place, "ckpt", strict=True, host="a")
    kept_elsewhere = check_host_copy(place, "ckpt", strict=True, host="d")  # a host that keeps neither missing file
    assert kept_elsewhere is not None and kept_elsewhere.here == ["__0_0.distcp"]
    assert check_host_copy(place, "elsewhere") is None
