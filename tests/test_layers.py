"""The package's layers: each module imports only from the layers below its own, so that data flows one way
(objects -> adapters -> saver -> format -> place) and a format never learns about the objects it stores."""

import ast
from pathlib import Path

import ignite_zero

PACKAGE = Path(ignite_zero.__file__).parent

# Lowest first. A module may import from its own role and from the layers below it, never from one above.
LAYERS: list[set[str]] = [
    {"_compat"},
    {"tree", "pickling", "naming", "rng", "sampling", "collector"},
    {"staging"},
    {"agreement", "transport", "storage.places"},
    {"storage.formats"},
    {"adapters", "storage.replicas"},
    {"storage.savers"},
    {"storage"},
    {"loading", "save_ranks"},
    {"checkpoint", "exporting"},
    {"model_checkpoint"},
    {"handlers", "cli"},
    {"__main__", "ignite_zero"},
]


def _role(module: str) -> str:
    """``storage.formats`` for ``ignite_zero.storage.formats.file``, ``adapters`` for ``ignite_zero.adapters.zero``."""
    parts = module.split(".")[1:]
    if not parts:
        return "ignite_zero"
    return ".".join(parts[:2]) if parts[0] == "storage" and len(parts) > 1 else parts[0]


def _level(role: str) -> int:
    return next(level for level, roles in enumerate(LAYERS) if role in roles)


def _is_module(name: str) -> bool:
    where = PACKAGE.parent.joinpath(*name.split("."))
    return where.with_suffix(".py").is_file() or (where / "__init__.py").is_file()


def _imports(path: Path) -> set[str]:
    """The modules of ours that ``path`` imports: for ``from package import x``, ``package.x`` where ``x`` is a
    module, else ``package``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "ignite_zero":
            for alias in node.names:
                if alias.name.startswith("__"):  # the package's metadata (__version__), not a layer's code
                    continue
                name = f"{node.module}.{alias.name}"
                found.add(name if _is_module(name) else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == "ignite_zero")
    return found


def _module_of(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_every_role_is_placed_in_a_layer():
    roles = {_role(_module_of(path)) for path in PACKAGE.rglob("*.py")}
    assert roles <= set().union(*LAYERS), f"roles without a layer: {sorted(roles - set().union(*LAYERS))}"


def test_modules_import_only_from_their_own_role_and_the_layers_below():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_of(path)
        role = _role(module)
        for imported in sorted(_imports(path)):
            target = _role(imported)
            if target != role and _level(target) >= _level(role):
                upward.append(f"{module} ({role}) imports {imported} ({target})")
    assert not upward, "imports from the same layer or above:\n" + "\n".join(upward)


def test_formats_know_only_bytes():
    """Formats read and write bytes: they import neither the adapters, nor loading, nor agreement."""
    for path in sorted((PACKAGE / "storage" / "formats").glob("*.py")):
        forbidden = [m for m in _imports(path) if _role(m) in ("adapters", "loading", "agreement", "storage.savers")]
        assert not forbidden, f"{path.name} imports {forbidden}"
