"""Run every notebook, one test each, as `nbdev-test` would: cells flagged `notest` or `cuda` are skipped.

`make gpu-test` sets DALI_FASTAI_NB_SKIP_FLAGS=notest and selects `-m gpu`: the notebooks with `#| cuda` cells then run
with those cells, on the GPU machine."""
import os, signal
from pathlib import Path

import pytest
import nbdev.test as nbt  # not `from nbdev.test import test_nb`: pytest would collect `test_nb` as a test

from helpers import gpu_marks

ROOT = Path(__file__).resolve().parents[1]
NBS = ROOT/'nbs'
NOTEBOOKS = sorted(NBS.glob('[0-9]*.ipynb')) + [p for p in [NBS/'index.ipynb'] if p.exists()]
SKIP_FLAGS = os.environ.get('DALI_FASTAI_NB_SKIP_FLAGS', 'notest cuda').split()
# A hung cell is reported by name after this long; pytest-timeout's per-test limit (pyproject.toml) is the backstop
CELL_TIMEOUT = 300


def has_cuda_cells(nb:Path)->bool: return '"#| cuda' in nb.read_text()


PARAMS = [pytest.param(nb, id=nb.name, marks=gpu_marks('`#| cuda` cells') if has_cuda_cells(nb) and 'cuda' not in SKIP_FLAGS
                       else []) for nb in NOTEBOOKS]


def test_some_notebooks_have_cuda_cells():
    "`make gpu-test` selects the notebooks by their `#| cuda` cells: a renamed flag would select none"
    assert [nb.name for nb in NOTEBOOKS if has_cuda_cells(nb)], "no notebook has a `#| cuda` cell"


@pytest.mark.parametrize('nb', PARAMS)
def test_notebook(nb, capfd):
    # test_nb runs the notebook with nbs/ as the working directory, and writes the failing cell's traceback to stderr
    handler = signal.getsignal(signal.SIGINT)  # nbdev's test_nb installs its own and leaves it: Ctrl-C tests after it would see it
    try: ok, secs = nbt.test_nb(nb, skip_flags=SKIP_FLAGS, showerr=True, cell_timeout=CELL_TIMEOUT)
    finally: signal.signal(signal.SIGINT, handler)
    err = capfd.readouterr().err
    assert ok, f"{nb.relative_to(ROOT)} failed after {secs:.0f}s:\n{err[-6000:]}"
