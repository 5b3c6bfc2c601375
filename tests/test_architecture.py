"""The package's shape: layers whose imports flow one way, no private names reached across modules, and a public API
that loads on demand."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import sb3_gpu

PACKAGE = Path(sb3_gpu.__file__).resolve().parent
# Each sub-package's layer; a module may import its own sub-package and lower layers, never a higher or a sibling one.
LAYERS = {"common": 0, "envs": 1, "extensions": 1, "config": 2, "planning": 3, "runs": 4, "tuning": 5, "benches": 5}
ROOT = 6  # sb3_gpu/__init__.py: the public API, which the entry points below may use
TOP = 7  # the command-line modules (train, evaluate, tune, bench, plot) and the sb3_gpu.per shim


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> tuple[int, str]:
    """(rank, group): modules of one group may import each other."""
    parts = module.split(".")
    if len(parts) == 1:
        return ROOT, module
    if parts[1] in LAYERS:
        return LAYERS[parts[1]], parts[1]
    return TOP, module


def _imports(path: Path) -> set[str]:
    """The sb3_gpu modules a file imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "sb3_gpu"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "sb3_gpu":
            found.add(node.module)
            # `from sb3_gpu.extensions.per import kernels` imports a module, not a name
            folder = PACKAGE.parent / node.module.replace(".", "/")
            found |= {
                f"{node.module}.{a.name}"
                for a in node.names
                if (folder / f"{a.name}.py").exists() or (folder / a.name / "__init__.py").exists()
            }
    return found


def import_edges() -> set[tuple[str, str]]:
    return {(_module_name(path), imported) for path in PACKAGE.rglob("*.py") for imported in _imports(path)}


def upward_edges(edges: set[tuple[str, str]]) -> list[str]:
    """Every edge that imports a higher layer or a sibling sub-package of the same layer."""
    bad = []
    for importer, imported in sorted(edges):
        (rank, group), (rank_to, group_to) = _layer(importer), _layer(imported)
        if group_to != group and rank_to >= rank:
            bad.append(f"{importer} -> {imported}")
    return bad


def test_every_module_belongs_to_a_known_layer():
    subpackages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert subpackages == set(LAYERS)


def test_imports_flow_one_way_from_the_entry_points_down_to_common():
    edges = import_edges()
    assert len(edges) > 100, "the walk found the package's imports"
    assert upward_edges(edges) == []


def test_the_layer_check_catches_an_upward_and_a_sideways_import():
    edges = {("sb3_gpu.common.io", "sb3_gpu.runs.rundir"), ("sb3_gpu.envs.build", "sb3_gpu.extensions.amp")}
    assert upward_edges(edges) == ["sb3_gpu.common.io -> sb3_gpu.runs.rundir", "sb3_gpu.envs.build -> sb3_gpu.extensions.amp"]
    assert upward_edges({("sb3_gpu.runs.session", "sb3_gpu")}) == ["sb3_gpu.runs.session -> sb3_gpu"]


def test_no_private_name_is_imported_from_another_module():
    private = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sb3_gpu"):
                names = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                private += [f"{_module_name(path)}: {node.module}.{name}" for name in names]
    assert private == []


@pytest.mark.parametrize("name", sb3_gpu.__all__)
def test_each_public_name_loads_from_the_module_that_owns_it(name):
    value = getattr(sb3_gpu, name)
    # Where it is defined, not a module that re-exports it (and would pull its own layer in with the import).
    assert (value.__module__, value.__name__) == (sb3_gpu._EXPORTS[name], name)


def test_the_public_api_lists_what_it_loads():
    assert sorted(sb3_gpu.__all__) == sorted(sb3_gpu._EXPORTS)


def test_importing_a_lower_layer_does_not_import_the_layers_above_it():
    code = "import sys, sb3_gpu.config.schema; print(sorted(m for m in sys.modules if m.startswith('sb3_gpu.')))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "sb3_gpu.config" in loaded
    assert not any(f"'sb3_gpu.{layer}" in loaded for layer in ("planning", "runs", "tuning", "benches"))


def test_no_module_imports_relatively_where_the_layer_check_could_not_see_it():
    relative = [
        f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
        for path in PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.ImportFrom) and node.level > 0
    ]
    assert relative == []
