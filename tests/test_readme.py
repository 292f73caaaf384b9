"README.md is generated from the index notebook: it must not drift, and the drift check must be able to fail"
import json, re, shutil, subprocess, sys
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


def readme_examples()->list:
    "The README's python blocks that no code cell of the index notebook holds (those run with the notebook, `test_notebooks.py`)"
    cells = {rd.split_directives(''.join(c['source']))[1].strip() for c in json.loads(INDEX.read_text())['cells']
             if c['cell_type'] == 'code'}
    blocks = re.findall(r'```python\n(.*?)\n```', (ROOT/'README.md').read_text(), flags=re.S)
    return [b for b in blocks if b.strip() not in cells]


def test_readme_examples_run_as_shown(tmp_path, monkeypatch):
    """The quick start (the README's python blocks the notebook does not run) runs as shown, on the CPU: `path` is a
    folder of the embedded images, two classes of 32 training and 32 validation images; the ImageNet weights are a
    random ResNet-18's, put where torchvision looks for them (no download); and the working directory is elsewhere, so
    that a relative file name that only works beside the data fails here"""
    blocks = readme_examples()
    assert len(blocks) == 1 and 'load_learner' in blocks[0], blocks
    import torch, torchvision
    from helpers import fmnist_path
    path = tmp_path/'images'
    for split,n in (('train', 32), ('valid', 32)):  # 64 validation images: val_bs=64 refuses fewer (issue 28, item 3)
        for c in ('Trouser', 'Bag'):
            (path/split/c).mkdir(parents=True)
            for f in sorted((fmnist_path()/split/c).glob('*.jpg'))[:n]: shutil.copy(f, path/split/c/f.name)
    weights = tmp_path/'torch'/'hub'/'checkpoints'/Path(torchvision.models.ResNet18_Weights.DEFAULT.url).name
    weights.parent.mkdir(parents=True)
    torch.save(torchvision.models.resnet18().state_dict(), weights)
    monkeypatch.setenv('TORCH_HOME', str(tmp_path/'torch'))
    (tmp_path/'elsewhere').mkdir(); monkeypatch.chdir(tmp_path/'elsewhere')
    ns = {'path': path}
    for b in blocks: exec(compile(b, 'README.md', 'exec'), ns)
    assert (path/'model.pkl').is_file() and not list((tmp_path/'elsewhere').iterdir())
    assert ns['learner'].dls.vocab == ['Bag', 'Trouser'] and ns['learn'].recorder.values  # it trained
    assert ns['learner'].predict(path/'valid'/'Bag'/sorted(p.name for p in (path/'valid'/'Bag').iterdir())[0])[0] in ('Bag', 'Trouser')
