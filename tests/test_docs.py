"""The docs short of Quarto: nbdev's processors turn every notebook into a page, and every exported name gets its
`show_doc` entry. (Rendering the pages to HTML needs Quarto, which is checked where Quarto is installed.)"""
import importlib, json, shutil, subprocess, sys
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parents[1]
NBS = sorted(p for p in (ROOT/'nbs').glob('*.ipynb') if not p.name.startswith('_'))


@pytest.fixture(scope='module')
def proc(tmp_path_factory):
    "Run nbdev's docs processors on a copy of the project; return the processed pages' folder"
    dest = tmp_path_factory.mktemp('docs')
    shutil.copytree(ROOT/'nbs', dest/'nbs')
    shutil.copytree(ROOT/'dali_fastai', dest/'dali_fastai')
    shutil.copy(ROOT/'pyproject.toml', dest/'pyproject.toml')
    res = subprocess.run([sys.executable, '-c', 'from nbdev.serve import proc_nbs; proc_nbs(n_workers=1)'],
                         cwd=dest, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return dest/'_proc'


def _markdown_outputs(page:Path)->str:
    nb = json.loads(page.read_text())
    return '\n'.join(''.join(o.get('data', {}).get('text/markdown', ''))
                     for c in nb['cells'] for o in c.get('outputs', []))


@pytest.mark.parametrize('nb', NBS, ids=[p.stem for p in NBS])
def test_every_notebook_becomes_a_page(proc, nb):
    assert (proc/nb.name).exists(), f"nbdev's processors made no page from {nb.name} (a cell mixing imports and code fails)"


def _module_of(nb:Path)->str|None:
    for c in json.loads(nb.read_text())['cells']:
        src = ''.join(c['source'])
        if src.startswith('#| default_exp'): return src.split()[2]


@pytest.mark.parametrize('nb', [p for p in NBS if _module_of(p) not in (None, 'all')], ids=lambda p: p.stem)
def test_every_exported_name_is_documented(proc, nb):
    mod = importlib.import_module(f'dali_fastai.{_module_of(nb)}')
    md = _markdown_outputs(proc/nb.name)
    missing = [n for n in mod.__all__ if callable(getattr(mod, n)) and f'### {n}' not in md]  # constants get no entry
    assert not missing, f"{nb.name}: no show_doc entry for {missing}"
