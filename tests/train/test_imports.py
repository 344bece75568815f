"""infinity/train's modules import each other without a circle: each depends on the ones below it (a lazy import
inside a function counts too: it is the same dependency, only later)."""

from __future__ import annotations

import ast
from pathlib import Path

TRAIN = Path(__file__).resolve().parents[2] / "infinity" / "train"


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "infinity.train":
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("infinity.train."):
            found.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[2] for a in node.names if a.name.startswith("infinity.train."))
    return found - {path.stem}


def test_no_import_circle():
    graph = {path.stem: _imports(path) for path in TRAIN.glob("*.py")}
    done: set[str] = set()

    def visit(module: str, trail: tuple[str, ...]) -> None:
        assert module not in trail, f"import circle: {' -> '.join((*trail, module))}"
        if module in done:
            return
        for imported in graph.get(module, ()):
            visit(imported, (*trail, module))
        done.add(module)

    for module in graph:
        visit(module, ())
    assert "plan" in graph["loop"] and "main" not in graph["loop"]
