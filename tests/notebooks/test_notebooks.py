"""Every notebook in notebooks/ runs top to bottom; a failing cell fails the suite."""

import contextlib
import json
import os
import time

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

from meshrl.procs import zygote
from tests.conftest import own_pids
from tests.support.notebooks import NOTEBOOKS


@pytest.fixture(scope="module")
def kernels(tmp_path_factory) -> KernelSpecManager:
    """A kernel spec like ipykernel's own whose kernel is a fork of the suite's
    server (`zygote.python_m`): it starts with torch imported."""
    folder = tmp_path_factory.mktemp("kernels")
    (folder / "forked").mkdir()
    spec = {
        "argv": zygote.python_m("ipykernel_launcher", "-f", "{connection_file}"),
        "display_name": "Python 3 (ipykernel, forked)",
        "language": "python",
        "interrupt_mode": "signal",
    }
    (folder / "forked" / "kernel.json").write_text(json.dumps(spec))
    return KernelSpecManager(kernel_dirs=[str(folder)])


@pytest.mark.notebook
@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path, kernels, tmp_path, no_stray_procs):
    notebook = nbformat.read(path, as_version=4)
    assert all(not cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"), (
        "commit notebooks without outputs"
    )
    # Unix sockets, not TCP: jupyter_client picks free TCP ports and frees them for the
    # kernel to bind, and a run on the other worker may take one meanwhile (the kernel
    # then dies before it answers).
    km = KernelManager(
        kernel_name="forked",
        kernel_spec_manager=kernels,
        transport="ipc",
        connection_file=str(tmp_path / "kernel.json"),
        ip=str(tmp_path / "kernel-ipc"),
    )
    try:
        NotebookClient(
            notebook, km=km, timeout=500, resources={"metadata": {"path": os.path.dirname(path)}}
        ).execute()
    finally:  # a client given its kernel manager leaves the kernel running
        if km.has_kernel:  # (one that died has no socket left to ask it to stop)
            km.shutdown_kernel(now=not km.is_alive())
    deadline = time.monotonic() + 30
    while kernel_forks() and time.monotonic() < deadline:  # (it exits a moment later)
        time.sleep(0.25)
    assert not kernel_forks(), "the notebook's kernel outlived it"


def kernel_forks() -> set[int]:
    """This pytest process's live forks of the server that run a module (the kernel)."""
    found = set()
    for pid in own_pids():
        with contextlib.suppress(OSError), open(f"/proc/{pid}/comm") as f:
            if f.read().strip() == zygote.RUN_COMM:
                found.add(pid)
    return found
