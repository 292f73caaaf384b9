"Run every notebook, one test each, as `nbdev-test` would: cells flagged `notest` or `cuda` are skipped"
from pathlib import Path

import pytest
import nbdev.test as nbt  # not `from nbdev.test import test_nb`: pytest would collect `test_nb` as a test

ROOT = Path(__file__).resolve().parents[1]
NBS = ROOT/'nbs'
NOTEBOOKS = sorted(NBS.glob('[0-9]*.ipynb')) + [p for p in [NBS/'index.ipynb'] if p.exists()]
SKIP_FLAGS = ['notest', 'cuda']  # `make gpu-test` runs the `cuda` cells on the GPU machine
# A hung cell is reported by name after this long; pytest-timeout's per-test limit (pyproject.toml) is the backstop
CELL_TIMEOUT = 300


@pytest.mark.parametrize('nb', NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook(nb, capfd):
    # test_nb runs the notebook with nbs/ as the working directory, and writes the failing cell's traceback to stderr
    ok, secs = nbt.test_nb(nb, skip_flags=SKIP_FLAGS, showerr=True, cell_timeout=CELL_TIMEOUT)
    err = capfd.readouterr().err
    assert ok, f"{nb.relative_to(ROOT)} failed after {secs:.0f}s:\n{err[-6000:]}"
