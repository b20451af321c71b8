"""Checkpoint formats, one module each, behind one protocol (:class:`~ignite_zero.storage.formats.base.Reader`).

=====================  =======================================================================================
``base``               the protocol, and what the formats share: :class:`IntegrityError`, :func:`crc32`
``file``               one file: torch's zip archive sealed with an integrity trailer, a consolidated save or
                       plain ``torch.save`` (:class:`FileReader` reads it)
``file_trailer``       the trailer written with the file (:class:`SealingStream`) and read back
``file_reads``         checked reads of parts of a file, straight into place
``file_verification``  a file checked against its trailer, whole (:func:`verify_file`)
``directory``          a sharded directory: ``torch.distributed.checkpoint``'s, sealed with a manifest of every file
                       (:class:`DirectoryWriter` writes it, :class:`DirectoryReader` reads it)
``dcp_files``          DCP's files, written straight from tensor memory and read into place, through a place
``dcp_entries``        the manifest's record of each entry of DCP's files, and its checked reads
``dcp_saved``          entries of DCP's files read without DCP's planning: tensors by name, a rank's own shards
``dcp_plans``          DCP's save plans, agreed in the saver's own rounds and kept between saves
``dcp_flat``           the flat names of a nested state's entries, as DCP saves and loads them
``consolidation``      a sharded directory read as one file's state, in bounded memory
``torch_zip``          ``torch.save``'s archive, written record by record
``trust``              what a checkpoint's pickles may build unless its user vouches for it
=====================  =======================================================================================

:func:`format_for` picks the reader of a checkpoint by what is stored under its name; outside this package, two
callers ask which format it holds: the mapping of objects to entries (:mod:`ignite_zero.loading.entries`), and the
command line's ``consolidate`` (:mod:`ignite_zero.cli`), which takes a sharded directory only.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ignite_zero.storage.formats.base import IntegrityError, Reader
from ignite_zero.storage.formats.directory import DirectoryReader
from ignite_zero.storage.formats.file import FileReader
from ignite_zero.storage.places import Place, split

__all__ = [
    "IntegrityError",
    "Reader",
    "format_for",
    "is_candidate",
    "reader_for",
]

_FORMATS: tuple[type[Reader], ...] = (FileReader, DirectoryReader)


def format_for(place: Place, name: str, is_directory: bool | None = None) -> Reader:
    """The reader of the checkpoint ``name`` in ``place``, in the format that what is stored under that name has: a
    directory is a sharded checkpoint, anything else a file.

    Args:
        place: the directory of checkpoints.
        name: the checkpoint's name there.
        is_directory: whether ``name`` is a directory, where a listing said so already.
    """
    if is_directory is None:
        is_directory = place.is_dir(name)
    kind = next(kind for kind in _FORMATS if kind.is_directory == is_directory)
    return kind.at(place, name)


def reader_for(where: str | Path, storage_options: Mapping[str, Any] | None = None) -> Reader:
    """The reader of the checkpoint at ``where``, a path or a URL (:func:`format_for`)."""
    parent, name = split(where, storage_options)
    return format_for(parent, name)


def is_candidate(name: str, is_directory: bool) -> bool:
    """Whether the entry ``name`` of a directory is named as a checkpoint of its kind (a file or a directory)."""
    return any(name.endswith(f".{kind.ext}") for kind in _FORMATS if kind.is_directory == is_directory)
