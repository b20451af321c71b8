"""``ignite-zero``: inspect, verify and consolidate checkpoints from the command line.

ignite-zero inspect ckpt/checkpoint_3.pt          # a file, or a sharded directory (.dcp)
ignite-zero verify ckpt/checkpoint_3.dcp
ignite-zero consolidate ckpt/checkpoint_3.dcp checkpoint_3.pt
ignite-zero verify s3://bucket/run/checkpoint_3.pt --storage-option endpoint_url=http://127.0.0.1:9000
python -m ignite_zero verify ckpt/checkpoint_3.pt
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ignite_zero import integrity, sharded, tree
from ignite_zero.adapters.zero import as_saved_optimizer_state
from ignite_zero.exporting import DTYPES, export
from ignite_zero.storage.files import DiskSaver
from ignite_zero.storage.places import is_url, split
from ignite_zero.storage.readers import DirectoryReader, FileReader, reader_for

__all__ = ["main"]

# A conversion reads this much at a time, and reports its progress after each.
_BATCH_BYTES = 256 * 2**20


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _origin(facts: Mapping[str, Any] | None, what: str) -> str:
    if not facts:
        return f"no ignite_zero {what} (written by another tool)"
    return (
        f"written by ignite_zero {facts.get('ignite_zero')} with torch {facts.get('torch')} on "
        f"{facts.get('world_size')} rank(s)"
    )


def _describe(dtype: torch.dtype, shape: Sequence[int]) -> str:
    numel = 1
    for extent in shape:
        numel *= extent
    return (
        f"{str(dtype).removeprefix('torch.')} {'x'.join(map(str, shape)) or 'scalar'} {_size(numel * dtype.itemsize)}"
    )


def _leaves(value: Any) -> list[tuple[str, Any]]:
    """Every leaf worth a line, with its dotted path: lists and tuples of plain values are shown whole."""

    def whole(node: Any) -> bool:
        return isinstance(node, (list, tuple)) and not any(isinstance(item, (Mapping, torch.Tensor)) for item in node)

    return [(".".join(map(str, path)), leaf) for path, leaf in tree.leaves(value, is_leaf=whole)]


def _inspect_file(reader: FileReader, out: TextIO) -> int:
    trailer = integrity.read_trailer(reader.stored)
    state = reader.structure(weights_only=True)
    print(f"{reader.path}: {_size(reader.stored.size)}, {_origin(trailer, 'integrity trailer')}", file=out)
    objects = state.items() if isinstance(state, Mapping) else [("(state)", state)]
    for name, value in objects:
        leaves = _leaves(value)
        tensors = [leaf for _, leaf in leaves if isinstance(leaf, torch.Tensor)]
        total = sum(t.numel() * t.element_size() for t in tensors)
        print(f"{name}: {type(value).__name__}, {len(tensors)} tensors, {_size(total)}", file=out)
        for key, leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                detail = _describe(leaf.dtype, tuple(leaf.shape))
            else:
                text = repr(leaf)
                detail = text if len(text) <= 60 else text[:57] + "..."
            print(f"  {key or '(value)'}: {detail}", file=out)
    return 0


def _inspect_directory(reader: DirectoryReader, out: TextIO) -> int:
    place = reader.place
    manifest = sharded.read_manifest(place)
    metadata = sharded.read_metadata(place)
    files = [name for name, is_directory in place.entries().items() if not is_directory]
    total = sum(place.size(name) for name in files)
    print(f"{reader.path}: sharded, {len(files)} files, {_size(total)}, {_origin(manifest, 'manifest')}", file=out)
    by_object: dict[str, list[tuple[str, Any]]] = {}
    for name, storage in metadata.state_dict_metadata.items():
        entry_path = sharded.path_of(metadata, name)
        by_object.setdefault(str(entry_path[0]), []).append((".".join(map(str, entry_path[1:])), storage))
    for name, entries in by_object.items():
        tensors = [s for _, s in entries if isinstance(s, TensorStorageMetadata)]
        nbytes = sum(s.size.numel() * s.properties.dtype.itemsize for s in tensors)
        print(f"{name}: {len(tensors)} tensors, {_size(nbytes)}", file=out)
        for key, storage in entries:
            if isinstance(storage, TensorStorageMetadata):
                detail = f"{_describe(storage.properties.dtype, tuple(storage.size))}, {len(storage.chunks)} shard(s)"
            else:
                detail = "value"
            print(f"  {key or '(value)'}: {detail}", file=out)
    return 0


def _verify(reader: FileReader | DirectoryReader, out: TextIO) -> int:
    path = reader.path
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a missing trailer or manifest is reported below, as the outcome
        if isinstance(reader, DirectoryReader):
            facts = sharded.verify(reader.place)
        else:
            facts = integrity.verify_file(reader.stored)  # every record, wherever the file lies
    if facts is None:
        what = "manifest" if isinstance(reader, DirectoryReader) else "integrity trailer"
        why = "written by another tool"
        if isinstance(reader, FileReader) and integrity.is_legacy_format(reader.stored):
            why = "torch's legacy format, `_use_new_zipfile_serialization=False`, has no room for one"
        print(f"{path}: no {what} to verify against ({why})", file=out)
        print(f"ignite-zero: warning: {path} loads, but without verification", file=sys.stderr)
        return 2
    if isinstance(reader, DirectoryReader):
        print(f"{path}: OK ({len(facts['files'])} files, sizes and CRC-32 match the manifest)", file=out)
    else:
        size = _size(reader.stored.size)
        print(f"{path}: OK ({size}, CRC-32 of every record and of the directory match)", file=out)
    return 0


def _consolidate(reader: FileReader | DirectoryReader, target: str, options: Mapping[str, Any], out: TextIO) -> int:
    """One file from a sharded checkpoint: what ``Checkpoint.load_objects`` reads anywhere, even without ranks."""
    directory, name = split(target, options if is_url(target) else None)
    if directory.is_file(name) or directory.is_dir(name):
        print(f"ignite-zero: {target} exists; consolidate never overwrites: choose another name", file=sys.stderr)
        return 1
    if not isinstance(reader, DirectoryReader):
        print(f"ignite-zero: {reader.path} is not a sharded checkpoint directory", file=sys.stderr)
        return 1
    source = reader.place
    started = time.perf_counter()
    sharded.verify(source)
    metadata = sharded.read_metadata(source)
    names = list(metadata.state_dict_metadata)
    sizes = {name: _nbytes(metadata.state_dict_metadata[name]) for name in names}
    total = sum(sizes.values())
    progress = _Progress("consolidating")
    done = 0
    flat: dict[str, Any] = {}
    for batch in _batches(names, sizes):  # the whole state is held at the end; batches only show progress
        wanted = set(batch)

        def keep(path: tuple[Any, ...], wanted: set[str] = wanted) -> bool:
            return sharded.name_of(path) in wanted

        part = sharded.template(metadata, keep)
        sharded.load(part, source)
        flat.update(part)
        done += sum(sizes[name] for name in batch)
        progress.update(done, total)
    state = {key: as_saved_optimizer_state(value) for key, value in sharded.nest(metadata, flat).items()}
    DiskSaver(directory, require_empty=False, save_on_rank=0)(state, name)
    progress.close()
    elapsed = time.perf_counter() - started
    print(f"{target}: {_size(directory.size(name))} from {reader.path} in {elapsed:.1f} s", file=out)
    return 0


def _nbytes(storage: Any) -> int:
    if isinstance(storage, TensorStorageMetadata):
        return storage.size.numel() * storage.properties.dtype.itemsize
    return 0


def _batches(names: list[str], sizes: Mapping[str, int]) -> Iterator[list[str]]:
    batch: list[str] = []
    held = 0
    for name in names:
        batch.append(name)
        held += sizes[name]
        if held >= _BATCH_BYTES:
            yield batch
            batch, held = [], 0
    if batch:
        yield batch


class _Progress:
    """A one-line progress bar on a terminal; nothing elsewhere, or for small conversions."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._out = sys.stderr
        self._shown: bool | None = None  # decided at the first update, once the total is known

    def update(self, done: int, total: int) -> None:
        if self._shown is None:
            self._shown = self._out.isatty() and total >= 2 * _BATCH_BYTES
        if self._shown:
            filled = int(30 * done / max(total, 1))
            bar = "#" * filled + "." * (30 - filled)
            line = f"\r{self._what} [{bar}] {100 * done / max(total, 1):3.0f}% of {_size(total)}"
            print(line, end="", file=self._out, flush=True)

    def close(self) -> None:
        if self._shown:
            print(file=self._out)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ignite-zero", description="Inspect, verify, consolidate and export ignite_zero checkpoints."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    storage = argparse.ArgumentParser(add_help=False)
    storage.add_argument(
        "--storage-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        type=_storage_option,
        help="an option of a URL's file system, as fsspec takes it (for S3: endpoint_url=..., key=..., "
        "secret=...); repeat for several. VALUE is read as JSON where it parses (true, 3), else as text. The "
        "environment supplies the rest, as for any fsspec client (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...).",
    )
    inspect = commands.add_parser(
        "inspect",
        parents=[storage],
        help="list the objects, tensors, shapes, dtypes and sizes of a checkpoint, and how it was written",
        description="List the objects, tensors, shapes, dtypes and sizes of a checkpoint file or sharded "
        "checkpoint directory, with the world size and the torch version it was saved with.",
    )
    inspect.add_argument("path", type=_where, help="checkpoint file, or sharded checkpoint directory: a path or a URL")
    verify = commands.add_parser(
        "verify",
        parents=[storage],
        help="check a checkpoint against its checksums; exit 1 if it is corrupt, truncated or incomplete",
        description="Check a checkpoint file against its integrity trailer, or a sharded directory against its "
        "manifest. Exit status: 0 when it matches, 1 when it is corrupt, truncated or incomplete, 2 when it "
        "carries nothing to check against.",
    )
    verify.add_argument("path", type=_where, help="checkpoint file, or sharded checkpoint directory: a path or a URL")
    consolidate = commands.add_parser(
        "consolidate",
        parents=[storage],
        help="turn a sharded checkpoint directory into one file that loads anywhere",
        description="Read a sharded checkpoint directory whole and write it as one checkpoint file, which "
        "Checkpoint.load_objects reads on any number of ranks or in one process. Holds the whole state in "
        "memory; never overwrites.",
    )
    consolidate.add_argument("source", type=_where, help="sharded checkpoint directory (.dcp): a path or a URL")
    consolidate.add_argument("target", type=_where, help="checkpoint file to write (a path or a URL); must not exist")
    export = commands.add_parser(
        "export",
        parents=[storage],
        help="write a model's weights as Hugging Face-style safetensors, tensor by tensor",
        description="Write the weights of one object of a checkpoint file or sharded directory as safetensors: "
        "model.safetensors, or shards and model.safetensors.index.json. Memory holds one tensor at a time; never "
        "overwrites.",
    )
    export.add_argument("source", type=_where, help="checkpoint file, or sharded checkpoint directory: a path or a URL")
    export.add_argument("target", type=_where, help="directory to write; must not exist")
    export.add_argument("--format", choices=["safetensors"], default="safetensors", help="output format")
    export.add_argument("--only", default="model", help="the object to export (default: model)")
    export.add_argument("--dtype", choices=sorted(DTYPES), help="convert floating-point weights")
    export.add_argument(
        "--max-shard-size", type=_byte_size, default="5GB", help="largest file, e.g. 5GB, 500MB (default: 5GB)"
    )
    return parser


def _byte_size(text: str) -> int:
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "B": 1}
    for unit, factor in units.items():
        if text.upper().endswith(unit) and text[: -len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(text[: -len(unit)]) * factor)
    if text.isdigit():
        return int(text)
    raise argparse.ArgumentTypeError(f"{text!r} is not a size: write it as 5GB, 500MB or a number of bytes")


def _export(args: argparse.Namespace, out: TextIO) -> int:
    if is_url(args.target):
        print("ignite-zero: export writes to a local directory only; copy it to the store afterwards", file=sys.stderr)
        return 1
    if Path(args.target).exists():
        print(f"ignite-zero: {args.target} exists; export never overwrites: choose another name", file=sys.stderr)
        return 1
    started = time.perf_counter()
    progress = _Progress("exporting")
    dtype = DTYPES[args.dtype] if args.dtype else None
    files = export(
        args.source,
        args.target,
        only=args.only,
        dtype=dtype,
        max_shard_size=args.max_shard_size,
        progress=progress.update,
        storage_options=dict(args.storage_option) or None,
    )
    progress.close()
    total = sum(path.stat().st_size for path in files)
    elapsed = time.perf_counter() - started
    print(f"{args.target}: {len(files)} files, {_size(total)} from {args.source} in {elapsed:.1f} s", file=out)
    return 0


def _where(text: str) -> str:
    """A URL as given, or a local path with ``~`` expanded."""
    return text if is_url(text) else str(Path(text.removeprefix("file://")).expanduser())


def _storage_option(text: str) -> tuple[str, Any]:
    key, equals, value = text.partition("=")
    if not equals or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE, e.g. endpoint_url=http://127.0.0.1:9000")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    args = _parser().parse_args(argv)
    where = args.source if args.command in ("consolidate", "export") else args.path
    options = dict(getattr(args, "storage_option", []))
    if options and not is_url(where):
        print(f"ignite-zero: --storage-option is for URLs, and {where} is a local path", file=sys.stderr)
        return 1
    try:
        if args.command == "export":
            return _export(args, sys.stdout)
        reader = reader_for(where, options or None)
        if isinstance(reader, FileReader) and not reader.place.is_file(reader.name):
            print(f"ignite-zero: {where} does not exist", file=sys.stderr)
            return 1
        if args.command == "inspect":
            if isinstance(reader, DirectoryReader):
                return _inspect_directory(reader, sys.stdout)
            return _inspect_file(reader, sys.stdout)
        if args.command == "verify":
            return _verify(reader, sys.stdout)
        return _consolidate(reader, args.target, options, sys.stdout)
    except (integrity.IntegrityError, KeyError, TypeError, ValueError, OSError) as error:
        print(f"ignite-zero: {error.args[0] if isinstance(error, KeyError) else error}", file=sys.stderr)
        return 1
