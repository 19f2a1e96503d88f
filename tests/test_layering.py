"""Layering: the core imports nothing from the commands, and no module uses a
command module (cli, chat, sweep) as a library. Imports are read with ``ast``
(function-local ones included), so nothing is imported to check."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "mlx_redrafter"
CORE = ["beam", "tree", "accept", "verify", "drafter", "generate", "measure", "lookup", "files", "models"]
# Command modules: a command's own parts (chat_session, ...) count as the command.
COMMANDS = ("mlx_redrafter.cli", "mlx_redrafter.chat", "mlx_redrafter.sweep", "mlx_redrafter.serve",
            "mlx_redrafter.train", "bench")


def module_name(path: Path) -> str:
    """The dotted name a file is imported as (converters/ ships as mlx_redrafter.converters)."""
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "converters":
        parts = ["mlx_redrafter"] + parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imported_modules(path: Path) -> set:
    """Every module ``path`` imports, relative imports resolved, ``from . import x`` as ``pkg.x``."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(parent + ([node.module] if node.module else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)  # `from pkg import submodule`
    return out


def is_command(module: str) -> bool:
    return any(module == c or module.startswith(c + ".") or module.startswith(c + "_") for c in COMMANDS)


def test_the_import_reader_sees_relative_and_local_imports(tmp_path):
    imports = imported_modules(PACKAGE / "cli.py")
    assert "mlx_redrafter.sweep" in imports and "mlx_redrafter.chat" in imports  # function-local, relative
    assert is_command("mlx_redrafter.chat_session") and is_command("mlx_redrafter.train.trainer")
    assert not is_command("mlx_redrafter.generate") and not is_command("mlx_redrafter.session")


@pytest.mark.parametrize("name", CORE)
def test_core_modules_import_no_command(name):
    path = PACKAGE / f"{name}.py"
    if not path.exists():
        pytest.skip(f"{name}.py does not exist in this tree")
    bad = sorted(m for m in imported_modules(path) if is_command(m))
    assert not bad, f"{name}.py imports command modules: {bad}"


def test_no_module_uses_a_command_module_as_a_library():
    """Only cli.py (and a command's own parts) may import chat, sweep or cli."""
    files = list(PACKAGE.rglob("*.py")) + list((REPO / "converters").rglob("*.py")) + list((REPO / "bench").rglob("*.py"))
    offenders = {}
    for path in files:
        me = module_name(path)
        for m in imported_modules(path):
            for cmd in ("mlx_redrafter.cli", "mlx_redrafter.chat", "mlx_redrafter.sweep"):
                own = me == cmd or me.startswith(cmd + "_") or me.startswith(cmd + ".")
                if not own and me != "mlx_redrafter.cli" and (m == cmd or m.startswith(cmd + ".")):
                    offenders.setdefault(str(path.relative_to(REPO)), []).append(m)
    assert not offenders, offenders
