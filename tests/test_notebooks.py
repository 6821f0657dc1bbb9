"""Every notebook in notebooks/ runs top to bottom; a failing cell fails the suite."""

import glob
import os

import nbformat
import pytest
from nbclient import NotebookClient

from tests.conftest import REPO

NOTEBOOKS = sorted(glob.glob(os.path.join(REPO, "notebooks", "*.ipynb")))


@pytest.mark.notebook
@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path, no_stray_procs):
    notebook = nbformat.read(path, as_version=4)
    assert all(not cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"), (
        "commit notebooks without outputs"
    )
    NotebookClient(
        notebook,
        timeout=500,
        kernel_name="python3",
        resources={"metadata": {"path": os.path.dirname(path)}},
    ).execute()


@pytest.mark.unit
def test_there_are_notebooks():
    assert NOTEBOOKS
