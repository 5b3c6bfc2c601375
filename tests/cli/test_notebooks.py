"""The notebooks run top to bottom in a real kernel (small budgets), and git holds them without outputs."""

from __future__ import annotations

import re

import pytest

from tests.conftest import REPO

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert {p.name for p in NOTEBOOKS} >= {"quickstart.ipynb", "dqn_per.ipynb"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name}: strip outputs before committing"


def _text(nb) -> str:
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            parts.append(out.get("text", ""))
            parts.append(str(out.get("data", {}).get("text/plain", "")))
    return "\n".join(parts)


@pytest.mark.heavy
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom(path, tmp_path, monkeypatch):
    monkeypatch.setenv("SB3_GPU_NOTEBOOK_SMOKE", "1")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
        coalesce_streams=True,  # a printed line arrives whole, not split where the kernel flushed
    )
    client.execute()  # raises CellExecutionError, naming the cell, on any error
    text = _text(nb)
    assert "sb3_gpu is installed" in text, "CI must skip the install cell (sb3_gpu is importable here)"
    if path.stem == "quickstart":
        assert "batched: BatchedSubprocVecEnv" in text and "subproc: SubprocVecEnv" in text
        assert "fallback: DummyVecEnv" in text and "could not start" in text
        assert "mean return" in text
        # The trained policy's video, embedded in the notebook as an HTML5 video of the mp4 it recorded.
        assert re.search(r"videos/quickstart.mp4: \d+ frames at 50 fps", text)
        assert any(
            "<video" in o.get("data", {}).get("text/html", "") and "data:video/mp4;base64," in o["data"]["text/html"]
            for c in nb.cells
            for o in c.get("outputs", [])
        ), "the video must be shown inline"
        assert any(
            o.get("output_type") == "display_data" and "image/png" in o.get("data", {})
            for c in nb.cells
            for o in c.get("outputs", [])
        ), "the learning curve must be drawn"
    else:
        # The preset's 3-step returns: SB3's NStepReplayBuffer without PER
        assert "PrioritizedReplayBuffer best eval" in text and "\nNStepReplayBuffer best eval" in text
        assert any(
            o.get("output_type") == "display_data" and "image/png" in o.get("data", {})
            for c in nb.cells
            for o in c.get("outputs", [])
        )
