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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import ignite
import torch

from ignite_zero import __version__
from ignite_zero.exporting import DTYPES, export
from ignite_zero.loading.whole import streamed_state
from ignite_zero.storage import replicas
from ignite_zero.storage.formats import IntegrityError, Reader, reader_for
from ignite_zero.storage.formats.base import UnsafeCheckpointError, human_size
from ignite_zero.storage.formats.consolidation import WINDOW_BYTES
from ignite_zero.storage.formats.directory import DirectoryReader
from ignite_zero.storage.places import is_url, split
from ignite_zero.storage.savers.disk import DiskSaver

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


# Conversions smaller than this end before a progress bar would tell anything.
_PROGRESS_FROM_BYTES = 512 * 2**20


def _origin(facts: Mapping[str, Any] | None, what: str) -> str:
    if not facts:
        return f"no ignite_zero {what} (written by another tool)"
    return (
        f"written by ignite_zero {facts.get('ignite_zero')} with torch {facts.get('torch')} on "
        f"{facts.get('world_size')} rank(s)"
    )


def _print_listing(listing: Mapping[str, Any], out: TextIO) -> None:
    if listing["format"] == "file":
        origin = _origin(listing["written_by"], "integrity trailer")
        print(f"{listing['path']}: {human_size(listing['bytes'])}, {origin}", file=out)
    else:
        origin = _origin(listing["written_by"], "manifest")
        size = human_size(listing["bytes"])
        print(f"{listing['path']}: sharded, {listing['files']} files, {size}, {origin}", file=out)
    for obj in listing["objects"]:
        kind = f"{obj['type']}, " if obj["type"] else ""
        print(f"{obj['name']}: {kind}{obj['tensors']} tensors, {human_size(obj['bytes'])}", file=out)
        for entry in obj["entries"]:
            if entry["kind"] == "tensor":
                shape = "x".join(map(str, entry["shape"])) or "scalar"
                detail = f"{entry['dtype']} {shape} {human_size(entry['bytes'])}"
                if "shards" in entry:
                    detail += f", {entry['shards']} shard(s)"
            else:
                text = entry.get("repr", "value")
                detail = text if len(text) <= 60 else text[:57] + "..."
            print(f"  {entry['key'] or '(value)'}: {detail}", file=out)


def _inspect(reader: Reader, as_json: bool, out: TextIO) -> int:
    listing = reader.listing()
    if as_json:
        json.dump(listing, out, indent=1)
        print(file=out)
    else:
        _print_listing(listing, out)
    return 0


def _verify(reader: Reader, out: TextIO, host_copy: replicas.HostCopy | None = None) -> int:
    path = reader.path
    if host_copy is not None and host_copy.elsewhere:  # one host's directory of a replicated checkpoint: what it holds
        total = len(host_copy.here) + len(host_copy.elsewhere)
        print(
            f"{path}: OK on {host_copy.host}: {len(host_copy.here)} of {total} files here, sizes and CRC-32 match the "
            f"manifest (replicated on {len(host_copy.hosts)} hosts, {', '.join(host_copy.hosts)}, with "
            f"replicas={host_copy.replicas})",
            file=out,
        )
        elsewhere = [f"{name} ({', '.join(hosts) or 'another host'})" for name, hosts in host_copy.elsewhere.items()]
        print(f"{path}: only on other hosts: {'; '.join(elsewhere)}", file=out)
        return 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a missing trailer or manifest is reported below, as the outcome
        verification = reader.verify()  # every record, wherever the checkpoint lies
    if not verification.checked:
        print(f"{path}: no {verification.record} to verify against ({verification.summary})", file=out)
        print(f"ignite-zero: warning: {path} loads, but without verification", file=sys.stderr)
        return 2
    print(f"{path}: OK ({verification.summary})", file=out)
    return 0


def _consolidate(reader: Reader, target: str, options: Mapping[str, Any], out: TextIO) -> int:
    """One file from a sharded checkpoint: what ``Checkpoint.load_objects`` reads anywhere, even without ranks."""
    directory, name = split(target, options if is_url(target) else None)
    if directory.is_file(name) or directory.is_dir(name):
        print(f"ignite-zero: {target} exists; consolidate never overwrites: choose another name", file=sys.stderr)
        return 1
    if not isinstance(reader, DirectoryReader):
        print(f"ignite-zero: {reader.path} is not a sharded checkpoint directory", file=sys.stderr)
        return 1
    started = time.perf_counter()
    progress = _Progress("consolidating")
    state, tensors = streamed_state(reader.place, progress.update, reader.trusted)
    try:
        DiskSaver(directory, require_empty=False, save_on_rank=0).write_streamed(
            state, name, tensors.bytes_of, tensors.read_all
        )
    finally:
        tensors.close()
        progress.close()
    elapsed = time.perf_counter() - started
    print(f"{target}: {human_size(directory.size(name))} from {reader.path} in {elapsed:.1f} s", file=out)
    return 0


class _Progress:
    """A one-line progress bar on a terminal; nothing elsewhere, or for small conversions."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._out = sys.stderr
        self._shown: bool | None = None  # decided at the first update, once the total is known

    def update(self, done: int, total: int) -> None:
        if self._shown is None:
            self._shown = self._out.isatty() and total >= _PROGRESS_FROM_BYTES
        if self._shown:
            filled = int(30 * done / max(total, 1))
            bar = "#" * filled + "." * (30 - filled)
            line = f"\r{self._what} [{bar}] {100 * done / max(total, 1):3.0f}% of {human_size(total)}"
            print(line, end="", file=self._out, flush=True)

    def close(self) -> None:
        if self._shown:
            print(file=self._out)


def _parser() -> argparse.ArgumentParser:
    """The ``ignite-zero`` command line: one subcommand per job, each with the storage options."""
    parser = argparse.ArgumentParser(
        prog="ignite-zero",
        description="Inspect, verify, consolidate and export ignite_zero checkpoints.",
        epilog="Each command's --help lists its exit statuses.",
    )
    parser.add_argument("--version", action="version", version=_version())
    commands = parser.add_subparsers(dest="command", required=True)
    storage = _storage_arguments()
    for name, command in _COMMANDS.items():
        command.arguments(
            commands.add_parser(
                name,
                parents=[storage],
                help=command.help,
                description=_wrap(command.description),
                epilog=command.epilog,
                formatter_class=argparse.RawDescriptionHelpFormatter,
            )
        )
    return parser


def _storage_arguments() -> argparse.ArgumentParser:
    """The options every subcommand shares: how to reach a URL, and whether to trust what a checkpoint holds."""
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
    storage.add_argument(
        "--trust",
        action="store_true",
        help="the checkpoint may run code when read: unpickle whatever it holds, as weights_only=False does in "
        "Python. Only for a checkpoint whose source you vouch for; without it, a pickle that would build anything "
        "but data is refused (exit status 1).",
    )
    return storage


def _inspect_arguments(inspect: argparse.ArgumentParser) -> None:
    inspect.add_argument("path", type=_where, help="checkpoint file, or sharded checkpoint directory: a path or a URL")
    inspect.add_argument("--json", action="store_true", help="print the listing as JSON, for scripts (see below)")


def _verify_arguments(verify: argparse.ArgumentParser) -> None:
    verify.add_argument("path", type=_where, help="checkpoint file, or sharded checkpoint directory: a path or a URL")


def _consolidate_arguments(consolidate: argparse.ArgumentParser) -> None:
    consolidate.add_argument("source", type=_where, help="sharded checkpoint directory (.dcp): a path or a URL")
    consolidate.add_argument("target", type=_where, help="checkpoint file to write (a path or a URL); must not exist")


def _export_arguments(export: argparse.ArgumentParser) -> None:
    export.add_argument("source", type=_where, help="checkpoint file, or sharded checkpoint directory: a path or a URL")
    export.add_argument("target", type=_where, help="directory to write; must not exist")
    export.add_argument("--format", choices=["safetensors"], default="safetensors", help="output format")
    export.add_argument("--only", default="model", help="the object to export (default: model)")
    export.add_argument("--dtype", choices=sorted(DTYPES), help="convert floating-point weights")
    export.add_argument(
        "--max-shard-size", type=_byte_size, default="5GB", help="largest file, e.g. 5GB, 500MB (default: 5GB)"
    )


@dataclass(frozen=True)
class _Command:
    """A subcommand's texts in ``--help``, and what adds its own arguments."""

    help: str
    description: str  # wrapped to the terminal's width
    epilog: str  # printed as written
    arguments: Callable[[argparse.ArgumentParser], None]


_COMMANDS = {
    "inspect": _Command(
        help="list the objects, tensors, shapes, dtypes and sizes of a checkpoint, and how it was written",
        description="List the objects, tensors, shapes, dtypes and sizes of a checkpoint file or sharded checkpoint "
        "directory, with the world size and the torch version it was saved with.",
        epilog=_JSON_SCHEMA
        + "\n"
        + _exit_status("0    listed", "1    missing, or not a checkpoint (truncated, corrupt, another format)"),
        arguments=_inspect_arguments,
    ),
    "verify": _Command(
        help="check a checkpoint against its checksums; exit 1 if it is corrupt, truncated or incomplete",
        description="Check a checkpoint file against its integrity trailer, or a sharded directory against its "
        "manifest. On one host's directory of a replicated checkpoint (ShardedSaver(..., replicas=k) on node-local "
        "disks), it checks the files that this host holds, fails if one that it keeps is missing, and names the "
        "files that live on other hosts only.",
        epilog=_exit_status(
            "0    it matches",
            "1    corrupt, truncated, incomplete or missing",
            usage="wrong arguments, or nothing to check against (another tool wrote it): it loads, unverified",
        ),
        arguments=_verify_arguments,
    ),
    "consolidate": _Command(
        help="turn a sharded checkpoint directory into one file that loads anywhere",
        description="Read a sharded checkpoint directory entry by entry and write it as one checkpoint file, which "
        "Checkpoint.load_objects reads on any number of ranks or in one process. Memory holds at most "
        f"{WINDOW_BYTES >> 20} MiB of the tensors' rows at a time, plus the non-tensor values, whatever the "
        "size of the checkpoint (a directory without a manifest, written by another tool, holds its "
        "largest tensor). Every entry is checked against the manifest as it is read; the file appears whole "
        "or not at all, and never overwrites.",
        epilog=_exit_status(
            "0    written", "1    the source is missing, not a sharded directory or corrupt, or the target exists"
        ),
        arguments=_consolidate_arguments,
    ),
    "export": _Command(
        help="write a model's weights as Hugging Face-style safetensors, tensor by tensor",
        description="Write the weights of one object of a checkpoint file or sharded directory as safetensors: "
        "model.safetensors, or shards and model.safetensors.index.json. Memory holds one tensor at a time; "
        "never overwrites.",
        epilog=_exit_status(
            "0    written",
            "1    the source is missing or corrupt, it has no such object, or the target exists",
        ),
        arguments=_export_arguments,
    ),
}


def _version() -> str:
    """This package's version, and those of the torch and ignite it runs with: what a bug report needs."""
    return f"ignite-zero {__version__} (torch {torch.__version__}, pytorch-ignite {ignite.__version__})"


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
        weights_only=not args.trust,
    )
    progress.close()
    total = sum(path.stat().st_size for path in files)
    elapsed = time.perf_counter() - started
    print(f"{args.target}: {len(files)} files, {human_size(total)} from {args.source} in {elapsed:.1f} s", file=out)
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
        reader.trusted = args.trust
        if not reader.exists():
            print(f"ignite-zero: {where} does not exist", file=sys.stderr)
            return 1
        if args.command == "inspect":
            return _inspect(reader, args.json, sys.stdout)
        if args.command == "verify":
            return _verify(
                reader,
                sys.stdout,
                replicas.check_host_copy(*split(where, options or None), strict=True) if reader.sharded else None,
            )
        return _consolidate(reader, args.target, options, sys.stdout)
    except BrokenPipeError:
        raise  # an OSError, but not the checkpoint's: main ends quietly
    except (IntegrityError, UnsafeCheckpointError, KeyError, TypeError, ValueError, OSError) as error:
        print(f"ignite-zero: {error.args[0] if isinstance(error, KeyError) else error}", file=sys.stderr)
        return 1
