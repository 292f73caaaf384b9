"README.md is generated from the index notebook: it must not drift, and the drift check must be able to fail"
import json, shutil, subprocess, sys
from pathlib import Path

import pytest

from helpers import load_tool

ROOT = Path(__file__).resolve().parents[1]
rd = load_tool('readme')
INDEX = rd.index_nb(ROOT)


def test_readme_is_up_to_date():
    assert INDEX.exists(), f"{INDEX} is missing: it is the docs home page and README.md is generated from it"
    msg = rd.check(ROOT)
    assert not msg, msg


def nb(*cells):
    "A notebook from (cell_type, source[, outputs]) tuples"
    def cell(i, typ, src, outs=()):
        c = dict(cell_type=typ, id=f'c{i}', metadata={}, source=src)
        return {**c, 'outputs': list(outs), 'execution_count': None} if typ == 'code' else c
    return dict(cells=[cell(i, *c) for i,c in enumerate(cells)], metadata={}, nbformat=4, nbformat_minor=5)

def stdout(text): return dict(output_type='stream', name='stdout', text=text)
def result(**data): return dict(output_type='execute_result', execution_count=1, metadata={}, data=data)


@pytest.fixture
def proj(tmp_path):
    "A throwaway project: our pyproject.toml, a small index notebook, and the README made from it"
    shutil.copy(ROOT/'pyproject.toml', tmp_path/'pyproject.toml')
    index = tmp_path/INDEX.relative_to(ROOT)
    index.parent.mkdir(parents=True)
    index.write_text(json.dumps(nb(
        ('markdown', '# dali_fastai\n\n> DALI pipelines for fastai'),
        ('code', '#| hide\nfrom dali_fastai.loader import *'),
        ('code', '#| export\ndef f(): pass'),
        ('markdown', '## Install\n\n```sh\npip install dali-fastai\n```'),
        ('code', '#|echo: false\nprint("shown")', [stdout('shown\n')]),
        ('code', '#| output: false\nx = 1\nx', [result(**{'text/plain': '1'})]),
        ('code', 'print("a"); 2', [stdout(['a\n']), dict(output_type='stream', name='stderr', text='warning\n'),
                                   result(**{'text/plain': ['2']})]),
        ('code', 'show()', [result(**{'text/markdown': '**bold**', 'text/plain': 'x'})]),
        ('markdown', '## Internal notes -'),
        ('raw', '---\ntitle: x\n---'),
    )))
    (tmp_path/'README.md').write_text(rd.readme(index, tmp_path))
    return tmp_path


def test_conversion(proj):
    assert (proj/'README.md').read_text() == '\n\n'.join([
        '<!-- GENERATED FILE: edit nbs/index.ipynb instead, then run `python tools/readme.py` -->',
        '# dali_fastai\n\n> DALI pipelines for fastai',
        '## Install\n\n```sh\npip install dali-fastai\n```',
        '```\nshown\n```',
        '```python\nx = 1\nx\n```',
        '```python\nprint("a"); 2\n```', '```\na\n2\n```',
        '```python\nshow()\n```', '**bold**',
    ]) + '\n'


def test_fence_outgrows_backticks():
    assert rd.fence('a ``` b', 'python') == '````python\na ``` b\n````'


def test_copy_starts_clean(proj): assert rd.check(proj) == ''


def test_notebook_change_is_drift(proj):
    index = proj/INDEX.relative_to(ROOT)
    index.write_text(index.read_text().replace('pip install dali-fastai', 'pip install dali_fastai'))
    msg = rd.check(proj)
    assert 'out of date' in msg and '+pip install dali_fastai' in msg and rd.CMD in msg


def test_hand_edit_is_drift(proj):
    (proj/'README.md').write_text((proj/'README.md').read_text() + '\nhand-written line\n')
    assert '-hand-written line' in rd.check(proj)


def test_cli(proj):
    def run(*args): return subprocess.run([sys.executable, ROOT/'tools'/'readme.py', '--root', proj, *args],
                                          capture_output=True, text=True)
    assert run('--check').returncode == 0
    (proj/'README.md').unlink()
    r = run('--check')
    assert r.returncode == 1 and 'out of date' in r.stderr, r
    assert run().returncode == 0 and run('--check').returncode == 0
    (proj/INDEX.relative_to(ROOT)).unlink()
    r = run('--check')
    assert r.returncode == 1 and 'index.ipynb not found' in r.stderr, r


def test_picture_links_point_from_the_root():
    "The notebook links pictures relative to nbs/, the README sits at the root: the README's links must still resolve"
    md = rd.cell_md(dict(cell_type='markdown', source='![chart](images/bench_h200.png) [site](https://x.org/a.png)'))
    assert md == ['![chart](nbs/images/bench_h200.png) [site](https://x.org/a.png)']
    for link in __import__('re').findall(r'\]\((nbs/[^)]+)\)', (ROOT/'README.md').read_text()):
        assert (ROOT/link).exists(), f"README links to {link}, which does not exist"
