"""The package's layout is its design: layers that import only downwards, no cycles, small modules.

Read from the source with :mod:`ast` (nothing is imported): every import
statement, at module level or inside a function, resolved to the module of
``picklehooks`` it names. The layers, bottom up, are in :data:`LAYERS`; the
docs' architecture page draws the same picture.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "picklehooks"

# The pinned runtime: saved files, generated hook text and torch.package archives name these
# modules, so they never move (see docs/contract.md). They import only each other.
PINNED = {"_shim", "_version", "_compat", "_state", "_shards", "_stats", "_native", "_deliver", "_ops", "_taps", "_views", "_swaps", "_sites",
          "_hookrt", "_speedups"}
# Rank of each top-level folder: a module may import its own folder and lower ranks only.
LAYERS = {"pinned": 0, "serialize": 1, "capture": 2, "audit": 2, "diagnostics": 3, "integrations": 3, "root": 4}
# Imports inside a function that reach up on purpose: thin delegations kept for the public API.
DELEGATIONS = {
    ("picklehooks.capture.log", "picklehooks.diagnostics.jacobian"),  # Log.vjp, Log.jacobian_norm
    ("picklehooks.capture.exports", "picklehooks.integrations.tensorboard"),  # Log.to_tensorboard
    ("picklehooks.capture.exports", "picklehooks.integrations.mlflow"),  # Log.to_mlflow
    ("picklehooks.capture.exports", "picklehooks.integrations.wandb"),  # Log.to_wandb
}
# One module is longer than the others on purpose: the shim travels alone, as one file, into
# torch.package archives and to hosts without picklehooks (tests/runtime/test_shim.py::test_shim_runs_alone).
LONG_ON_PURPOSE = {"picklehooks._shim"}
MAX_MODULE_LINES, MAX_CLASS_LINES = 500, 200


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in ("__main__", "demo"):
        return "root"
    if parts[1] in PINNED:
        return "pinned"
    return parts[1]


def _resolve(module: str, name: str) -> str:
    """The module of ours that ``name`` (a dotted path that may end in an attribute) is, or is in."""
    while name not in MODULES and "." in name:
        name = name.rpartition(".")[0]
    return name


def _imports(module: str) -> list[tuple[str, bool]]:
    """``(imported module, at module level)`` for every import of ours in ``module``'s source."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names] if base else []
        for name in names:
            if name.split(".")[0] == "picklehooks":
                found.append((_resolve(module, name), id(node) in top_level))
    return found


def test_every_module_is_in_a_layer():
    unknown = sorted({_layer(m) for m in MODULES} - set(LAYERS))
    assert not unknown, f"folders with no layer in tests/test_layout.py's LAYERS: {unknown}"


def test_layers_import_only_downwards():
    wrong = []
    for module in MODULES:
        mine = _layer(module)
        for target, _ in _imports(module):
            theirs = _layer(target)
            if (module, target) in DELEGATIONS or theirs == mine:
                continue
            if LAYERS[theirs] >= LAYERS[mine]:
                wrong.append(f"{module} ({mine}) imports {target} ({theirs})")
    assert not wrong, "\n".join(wrong)


def test_the_shim_imports_nothing_of_ours():
    """It travels alone into torch.package archives: stdlib and zstd only."""
    assert _imports("picklehooks._shim") == []


def test_no_import_cycles():
    """Module-level imports (what runs at import time) form no cycle."""
    graph = {m: {t for t, top in _imports(m) if top and t != m} for m in MODULES}
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            # A package's __init__ importing its own submodules is how packages work.
            if node == nxt.rpartition(".")[0] or nxt not in graph:
                continue
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for module in graph:
        if module not in state:
            visit(module, [module])
    assert not cycles, "\n".join(cycles)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_modules_and_classes_are_small(module):
    source = MODULES[module].read_text(encoding="utf-8")
    lines = source.count("\n")
    if module not in LONG_ON_PURPOSE:
        assert lines <= MAX_MODULE_LINES, f"{module} has {lines} lines; split it by concern"
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            size = node.end_lineno - node.lineno + 1
            assert size <= MAX_CLASS_LINES, f"{module}.{node.name} has {size} lines; split it by concern"


def test_a_module_moved_by_the_layout_still_imports_from_its_old_path():
    """Public modules' old paths work for one release, warning; the object is the moved module."""
    from tests.testutils import run_fresh

    out = run_fresh(
        """
        import importlib, sys, warnings
        import picklehooks._compat as compat
        for old, new in compat.MOVED.items():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                module = importlib.import_module(old)
            assert module is importlib.import_module(new), (old, module)
            # Named at the importing line (here "<string>"), where Python's default filters show it.
            assert [w.filename for w in caught if new in str(w.message)] == ["<string>"], (old, caught)
        import picklehooks
        del sys.modules["picklehooks.mlflow"], picklehooks.mlflow  # as before its first use
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert picklehooks.mlflow is importlib.import_module("picklehooks.integrations.mlflow")
        assert [w.filename for w in caught if "picklehooks.mlflow moved" in str(w.message)] == ["<string>"]
        print(len(compat.MOVED))
        """
    )
    assert out.split() == ["9"]
