"""Clear outputs and execution counts from notebooks in place: ``python tools/strip_notebooks.py notebooks/*.ipynb``."""

from __future__ import annotations

import sys

import nbformat


def strip(path: str) -> bool:
    """Strip one notebook; return whether it changed."""
    nb = nbformat.read(path, as_version=4)
    changed = False
    for cell in nb.cells:
        if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None):
            cell.outputs, cell.execution_count, changed = [], None, True
    if changed:
        nbformat.write(nb, path)
    return changed


if __name__ == "__main__":
    for name in sys.argv[1:]:
        print(("stripped " if strip(name) else "clean    ") + name)
