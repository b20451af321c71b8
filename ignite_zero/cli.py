"""``ignite-zero``: inspect, verify, consolidate and export checkpoints from the command line.

ignite-zero inspect ckpt/checkpoint_3.pt          # a file, or a sharded directory (.dcp)
ignite-zero inspect --json ckpt/checkpoint_3.pt   # the same listing for scripts; the schema is in --help
ignite-zero verify ckpt/checkpoint_3.dcp
ignite-zero consolidate ckpt/checkpoint_3.dcp checkpoint_3.pt
ignite-zero export ckpt/checkpoint_3.pt hf/model --dtype bf16
ignite-zero verify s3://bucket/run/checkpoint_3.pt --storage-option endpoint_url=http://127.0.0.1:9000
python -m ignite_zero verify ckpt/checkpoint_3.pt
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
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

# The status a tool killed by SIGPIPE reports to its shell (128 + 13): a reader that left early, as `| head` does.
_EXIT_PIPE_CLOSED = 141

_JSON_SCHEMA = """\
--json prints one JSON object (schema 1):
  {"schema": 1, "path": str, "format": "file" | "sharded", "files": int, "bytes": int,
   "written_by": {"ignite_zero": str, "torch": str, "world_size": int} | null (another tool wrote it),
   "objects": [{"name": str, "type": str | null (sharded), "tensors": int, "bytes": int,
                "entries": [{"key": str (dotted path in the object, "" for the object itself),
                             "kind": "tensor", "dtype": str, "shape": [int], "bytes": int,
                             "shards": int (sharded only)}
                          | {"key": str, "kind": "value",
                             "repr": str (files only), "value": any (files only, where JSON holds it)}]}]}
"""


def _exit_status(*specific: str, usage: str = "wrong arguments") -> str:
    """The epilog of a command's help: its exit statuses, then those every command shares."""
    lines = [*specific, f"2    {usage}", f"{_EXIT_PIPE_CLOSED}  the output was closed early (e.g. `| head`)"]
    return "exit status:\n" + "\n".join(f"  {line}" for line in lines)


def _wrap(text: str) -> str:
    """A description, wrapped here because the help keeps the line breaks of the exit-status tables."""
    return textwrap.fill(text, width=100)


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


def _leaves(value: Any) -> list[tuple[str, Any]]:
    """Every leaf worth a line, with its dotted path: lists and tuples of plain values are shown whole."""

    def whole(node: Any) -> bool:
        return isinstance(node, (list, tuple)) and not any(isinstance(item, (Mapping, torch.Tensor)) for item in node)

    return [(".".join(map(str, path)), leaf) for path, leaf in tree.leaves(value, is_leaf=whole)]


def _tensor_entry(key: str, dtype: torch.dtype, shape: Sequence[int]) -> dict[str, Any]:
    numel = 1
    for extent in shape:
        numel *= extent
    name = str(dtype).removeprefix("torch.")
    return {"key": key, "kind": "tensor", "dtype": name, "shape": list(shape), "bytes": numel * dtype.itemsize}


def _value_entry(key: str, value: Any) -> dict[str, Any]:
    entry = {"key": key, "kind": "value", "repr": repr(value)}
    try:  # the value itself where JSON holds it exactly: numbers, strings, lists of them
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return entry
    return {**entry, "value": value}


def _object(name: str, type_name: str | None, entries: list[dict[str, Any]]) -> dict[str, Any]:
    tensors = [entry for entry in entries if entry["kind"] == "tensor"]
    nbytes = sum(entry["bytes"] for entry in tensors)
    return {"name": name, "type": type_name, "tensors": len(tensors), "bytes": nbytes, "entries": entries}


def _written_by(facts: Mapping[str, Any] | None) -> dict[str, Any] | None:
    return {key: facts.get(key) for key in ("ignite_zero", "torch", "world_size")} if facts else None


def _list_file(reader: FileReader) -> dict[str, Any]:
    trailer = integrity.read_trailer(reader.stored)
    state = reader.structure(weights_only=True)
    objects = []
    for name, value in state.items() if isinstance(state, Mapping) else [("(state)", state)]:
        entries = [
            _tensor_entry(key, leaf.dtype, tuple(leaf.shape))
            if isinstance(leaf, torch.Tensor)
            else _value_entry(key, leaf)
            for key, leaf in _leaves(value)
        ]
        objects.append(_object(str(name), type(value).__name__, entries))
    return {
        "schema": 1,
        "path": str(reader.path),
        "format": "file",
        "files": 1,
        "bytes": reader.stored.size,
        "written_by": _written_by(trailer),
        "objects": objects,
    }


def _list_directory(reader: DirectoryReader) -> dict[str, Any]:
    place = reader.place
    manifest = sharded.read_manifest(place)
    metadata = sharded.read_metadata(place)
    files = [name for name, is_directory in place.entries().items() if not is_directory]
    by_object: dict[str, list[dict[str, Any]]] = {}
    for name, storage in metadata.state_dict_metadata.items():
        entry_path = sharded.path_of(metadata, name)
        key = ".".join(map(str, entry_path[1:]))
        if isinstance(storage, TensorStorageMetadata):
            entry = {**_tensor_entry(key, storage.properties.dtype, tuple(storage.size)), "shards": len(storage.chunks)}
        else:
            entry = {"key": key, "kind": "value"}  # not read: a listing reads the metadata only
        by_object.setdefault(str(entry_path[0]), []).append(entry)
    return {
        "schema": 1,
        "path": str(reader.path),
        "format": "sharded",
        "files": len(files),
        "bytes": sum(place.size(name) for name in files),
        "written_by": _written_by(manifest),
        "objects": [_object(name, None, entries) for name, entries in by_object.items()],
    }


def _print_listing(listing: Mapping[str, Any], out: TextIO) -> None:
    if listing["format"] == "file":
        origin = _origin(listing["written_by"], "integrity trailer")
        print(f"{listing['path']}: {_size(listing['bytes'])}, {origin}", file=out)
    else:
        origin = _origin(listing["written_by"], "manifest")
        print(f"{listing['path']}: sharded, {listing['files']} files, {_size(listing['bytes'])}, {origin}", file=out)
    for obj in listing["objects"]:
        kind = f"{obj['type']}, " if obj["type"] else ""
        print(f"{obj['name']}: {kind}{obj['tensors']} tensors, {_size(obj['bytes'])}", file=out)
        for entry in obj["entries"]:
            if entry["kind"] == "tensor":
                detail = f"{entry['dtype']} {'x'.join(map(str, entry['shape'])) or 'scalar'} {_size(entry['bytes'])}"
                if "shards" in entry:
                    detail += f", {entry['shards']} shard(s)"
            else:
                text = entry.get("repr", "value")
                detail = text if len(text) <= 60 else text[:57] + "..."
            print(f"  {entry['key'] or '(value)'}: {detail}", file=out)


def _inspect(reader: FileReader | DirectoryReader, as_json: bool, out: TextIO) -> int:
    listing = _list_directory(reader) if isinstance(reader, DirectoryReader) else _list_file(reader)
    if as_json:
        json.dump(listing, out, indent=1)
        print(file=out)
    else:
        _print_listing(listing, out)
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
        prog="ignite-zero",
        description="Inspect, verify, consolidate and export ignite_zero checkpoints.",
        epilog="Each command's --help lists its exit statuses.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    raw = argparse.RawDescriptionHelpFormatter
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
        description=_wrap(
            "List the objects, tensors, shapes, dtypes and sizes of a checkpoint file or sharded checkpoint "
            "directory, with the world size and the torch version it was saved with."
        ),
        epilog=_JSON_SCHEMA
        + "\n"
        + _exit_status("0    listed", "1    missing, or not a checkpoint (truncated, corrupt, another format)"),
        formatter_class=raw,
    )
    inspect.add_argument("path", type=_where, help="checkpoint file, or sharded checkpoint directory: a path or a URL")
    inspect.add_argument("--json", action="store_true", help="print the listing as JSON, for scripts (see below)")
    verify = commands.add_parser(
        "verify",
        parents=[storage],
        help="check a checkpoint against its checksums; exit 1 if it is corrupt, truncated or incomplete",
        description=_wrap(
            "Check a checkpoint file against its integrity trailer, or a sharded directory against its manifest."
        ),
        epilog=_exit_status(
            "0    it matches",
            "1    corrupt, truncated, incomplete or missing",
            usage="wrong arguments, or nothing to check against (another tool wrote it): it loads, unverified",
        ),
        formatter_class=raw,
    )
    verify.add_argument("path", type=_where, help="checkpoint file, or sharded checkpoint directory: a path or a URL")
    consolidate = commands.add_parser(
        "consolidate",
        parents=[storage],
        help="turn a sharded checkpoint directory into one file that loads anywhere",
        description=_wrap(
            "Read a sharded checkpoint directory whole and write it as one checkpoint file, which "
            "Checkpoint.load_objects reads on any number of ranks or in one process. Holds the whole state in "
            "memory; never overwrites."
        ),
        epilog=_exit_status(
            "0    written", "1    the source is missing, not a sharded directory or corrupt, or the target exists"
        ),
        formatter_class=raw,
    )
    consolidate.add_argument("source", type=_where, help="sharded checkpoint directory (.dcp): a path or a URL")
    consolidate.add_argument("target", type=_where, help="checkpoint file to write (a path or a URL); must not exist")
    export = commands.add_parser(
        "export",
        parents=[storage],
        help="write a model's weights as Hugging Face-style safetensors, tensor by tensor",
        description=_wrap(
            "Write the weights of one object of a checkpoint file or sharded directory as safetensors: "
            "model.safetensors, or shards and model.safetensors.index.json. Memory holds one tensor at a time; "
            "never overwrites."
        ),
        epilog=_exit_status(
            "0    written",
            "1    the source is missing or corrupt, it has no such object, or the target exists",
        ),
        formatter_class=raw,
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
    try:
        status = _run(args)
        sys.stdout.flush()  # so that a closed pipe shows here, not as a traceback at exit
    except BrokenPipeError:
        # The reader left (`ignite-zero inspect big.pt | head`): end quietly. Python's own flush at exit would
        # fail again on the dead pipe, so stdout goes to /dev/null first.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return _EXIT_PIPE_CLOSED
    return status


def _run(args: argparse.Namespace) -> int:
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
            return _inspect(reader, args.json, sys.stdout)
        if args.command == "verify":
            return _verify(reader, sys.stdout)
        return _consolidate(reader, args.target, options, sys.stdout)
    except BrokenPipeError:
        raise  # an OSError, but not the checkpoint's: main ends quietly
    except (integrity.IntegrityError, KeyError, TypeError, ValueError, OSError) as error:
        print(f"ignite-zero: {error.args[0] if isinstance(error, KeyError) else error}", file=sys.stderr)
        return 1
