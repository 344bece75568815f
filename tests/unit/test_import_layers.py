"""infinity's modules import each other without a circle, and each layer only what lies below it: the I/O engine
(aio/) and the tiers (memory/) know nothing of ZeRO, ZeRO (zero/) nothing of the engines, checkpoints or
commands built on it. A lazy import inside a function counts too (the same dependency, only later); an import
under ``if TYPE_CHECKING`` counts as well (it says which way the layers depend)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "infinity"

# What each layer must never import (a module's layer: its subpackage, or the top-level module itself).
ABOVE_ZERO = {"zero", "engine", "entry", "inference", "checkpoint", "train", "integrations", "budget", "estimate",
              "cli", "generation"}  # fmt: skip
FORBIDDEN = {
    "aio": ABOVE_ZERO | {"memory"},
    "memory": ABOVE_ZERO,
    "comm": ABOVE_ZERO | {"memory", "aio"},
    "zero": ABOVE_ZERO - {"zero"},
    "engine": {"entry", "inference", "train", "integrations", "estimate", "cli"},
    "inference": {"entry", "train", "integrations", "estimate", "cli"},
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("infinity"):
                # `from infinity.zero import collectives` imports a submodule, not the package's re-exports
                subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules]
                found.update(subs or [node.module])
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("infinity."))
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_no_import_circle():
    graph = _graph()
    # a package's __init__ re-exporting its submodules is not a dependency of theirs on it
    edges = {m: {t for t in targets if not m.startswith(t + ".")} for m, targets in graph.items()}
    done: set[str] = set()

    def visit(module: str, trail: tuple[str, ...]) -> None:
        assert module not in trail, f"import circle: {' -> '.join((*trail, module))}"
        if module in done:
            return
        for imported in sorted(edges.get(module, ())):
            visit(imported, (*trail, module))
        done.add(module)

    for module in sorted(edges):
        visit(module, ())


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_no_upward_import(layer):
    wrong = [f"{module} imports {target}" for module, targets in sorted(_graph().items()) if _layer(module) == layer
             for target in sorted(targets) if _layer(target) in FORBIDDEN[layer]]  # fmt: skip
    assert not wrong, "; ".join(wrong)


def test_the_train_command_reads_its_plan_not_its_options_parser():
    graph = _graph()
    assert "infinity.train.plan" in graph["infinity.train.loop"]
    assert "infinity.train.main" not in graph["infinity.train.loop"]
