"""What one host holds of a replicated checkpoint: its directory's files checked against the manifest."""

from __future__ import annotations

import json
import logging
import socket
import zlib
from dataclasses import dataclass
from typing import Any

from ignite_zero.storage.formats.base import IntegrityError
from ignite_zero.storage.formats.directory import MANIFEST, check_file, check_unlisted, read_manifest
from ignite_zero.storage.places import Place

__all__ = ["HostCopy", "check_host_copy", "replicated"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HostCopy:
    """What one host's directory holds of a replicated checkpoint, checked against the manifest.

    Attributes:
        host: the host it was checked on.
        hosts: the hosts of the checkpoint.
        replicas: the copies of each file on other hosts than its writer's.
        files: every file that the manifest lists, with its size and CRC-32.
        good: the files here whose size (and CRC-32, where checked) match the manifest.
        elsewhere: the files absent here that this host does not keep, each with the hosts that keep it.
    """

    host: str
    hosts: list[str]
    replicas: int
    files: dict[str, tuple[int, int]]
    good: frozenset[str]
    elsewhere: dict[str, list[str]]

    @property
    def identity(self) -> int:
        """The checksum of the manifest's list of files: the same on every host that holds this checkpoint."""
        return zlib.crc32(json.dumps(self.files, sort_keys=True).encode())

    @property
    def here(self) -> list[str]:
        """The files here that match the manifest, by name."""
        return sorted(self.good)


def replicated(place: Place, name: str) -> tuple[Place, dict[str, Any]] | None:
    """The directory of the checkpoint ``name`` of ``place`` and its manifest, if it is a sealed, replicated one."""
    directory = place.child(name)
    if not directory.is_whole(MANIFEST) or not directory.is_file(MANIFEST):
        return None
    manifest = read_manifest(directory)
    if manifest is None or "replicas" not in manifest:
        return None
    return directory, manifest


def check_host_copy(
    place: Place, name: str, *, strict: bool = False, verify: bool = True, host: str | None = None
) -> HostCopy | None:
    """Check what this host (``host``, by default this machine's name) holds of the replicated checkpoint ``name``
    of ``place``: every file present against the manifest.

    Lenient (a load, :func:`~ignite_zero.find_latest`): a file that does not match is left out of
    :attr:`HostCopy.good` (a corrupt one with a warning), to be fetched again. Strict (``ignite-zero verify``): the
    first problem raises, and so does a file that this host keeps but lacks.

    Args:
        place: the directory of checkpoints.
        name: the checkpoint's name in it.
        strict: raise on the first problem instead of leaving the file out.
        verify: check CRC-32s too, not sizes only (always, when ``strict``).
        host: the host the directory belongs to.

    Returns:
        What the host holds; ``None`` when ``name`` is no sealed replicated checkpoint here (absent, uncommitted, or
        not replicated).

    Raises:
        IntegrityError: when ``strict``: a file here is truncated or corrupt, a file this host keeps is missing, or a
            ``.distcp`` file here is not in the manifest.
    """
    found = replicated(place, name)
    if found is None:
        return None
    directory, manifest = found
    host = socket.gethostname() if host is None else host
    keepers: dict[str, list[str]] = manifest.get("keepers", {})
    files = {file: (int(record["size"]), int(record["crc32"])) for file, record in manifest["files"].items()}
    present = directory.file_sizes()
    good, elsewhere = [], {}
    for file in sorted(files) if strict else files:
        if file not in present:
            kept_by = keepers.get(file, [])
            if strict and host in kept_by:
                raise IntegrityError(
                    f"{directory}: file {file} is missing, and this host ({host}) is one of those that keep it "
                    f"({', '.join(kept_by)}): load the checkpoint on every host once to fetch it again"
                )
            elsewhere[file] = kept_by
        elif _matches(directory, file, files[file], present, strict, verify or strict):
            good.append(file)
    if strict:
        check_unlisted(directory, present, files)
    return HostCopy(host, list(manifest.get("hosts", [])), int(manifest["replicas"]), files, frozenset(good), elsewhere)


def _matches(
    directory: Place, file: str, record: tuple[int, int], present: dict[str, int], strict: bool, verify: bool
) -> bool:
    """Whether ``file`` (``present``: the sizes of the files here) matches its ``record`` in the manifest; when
    ``strict``, raise if not."""
    size, crc = record
    try:
        check_file(directory, file, size, crc if verify else None, present)
    except IntegrityError as error:
        if strict:
            raise
        if present[file] == size:  # the size matched: bytes changed on this disk, not a write cut short
            logger.warning("%s", error)
        return False
    return True
