"""``ignite-zero``: inspect, verify and consolidate checkpoints from the command line.

ignite-zero inspect checkpoint_3.pt
ignite-zero verify checkpoint_3.pt
python -m ignite_zero verify checkpoint_3.pt
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ignite_zero import integrity

__all__ = ["main"]


def _leaves(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    if isinstance(value, Mapping):
        for key, item in value.items():
            yield from _leaves(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, (list, tuple)) and any(isinstance(item, (Mapping, torch.Tensor)) for item in value):
        for index, item in enumerate(value):
            yield from _leaves(item, f"{path}.{index}")
    else:
        yield path, value


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _inspect(path: Path, out: Any) -> int:
    trailer = integrity.read_trailer(path)
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    origin = (
        f"written by ignite_zero {trailer.get('ignite_zero')} with torch {trailer.get('torch')} on "
        f"{trailer.get('world_size')} rank(s)"
        if trailer
        else "no ignite_zero trailer (written by another tool)"
    )
    print(f"{path}: {_size(path.stat().st_size)}, {origin}", file=out)
    objects = state.items() if isinstance(state, Mapping) else [("(state)", state)]
    for name, value in objects:
        leaves = list(_leaves(value, ""))
        tensors = [leaf for _, leaf in leaves if isinstance(leaf, torch.Tensor)]
        total = sum(t.numel() * t.element_size() for t in tensors)
        print(f"{name}: {type(value).__name__}, {len(tensors)} tensors, {_size(total)}", file=out)
        for key, leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                shape = "x".join(map(str, leaf.shape)) or "scalar"
                detail = f"{str(leaf.dtype).removeprefix('torch.')} {shape} {_size(leaf.numel() * leaf.element_size())}"
            else:
                text = repr(leaf)
                detail = text if len(text) <= 60 else text[:57] + "..."
            print(f"  {key or '(value)'}: {detail}", file=out)
    return 0


def _verify(path: Path, out: Any) -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a missing trailer is reported below, as the outcome
        trailer = integrity.verify_file(path)
    if trailer is None:
        print(f"{path}: no integrity trailer to verify against (written by another tool)", file=out)
        return 2
    print(f"{path}: OK ({_size(path.stat().st_size)}, CRC-32 of every record and of the directory match)", file=out)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ignite-zero", description="Inspect and verify ignite_zero checkpoints.")
    commands = parser.add_subparsers(dest="command", required=True)
    inspect = commands.add_parser("inspect", help="list the objects, tensors, shapes, dtypes and sizes of a checkpoint")
    inspect.add_argument("path", type=Path, help="checkpoint file")
    verify = commands.add_parser(
        "verify", help="check a checkpoint against its integrity trailer; exit 1 if corrupt, truncated or incomplete"
    )
    verify.add_argument("path", type=Path, help="checkpoint file")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    args = _parser().parse_args(argv)
    if not args.path.exists():
        print(f"ignite-zero: {args.path} does not exist", file=sys.stderr)
        return 1
    try:
        if args.command == "inspect":
            return _inspect(args.path, sys.stdout)
        return _verify(args.path, sys.stdout)
    except integrity.IntegrityError as error:
        print(f"ignite-zero: {error}", file=sys.stderr)
        return 1
