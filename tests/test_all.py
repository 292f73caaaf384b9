"""Every name of ours the docs use comes from `dali_fastai.all`: names in backticks in the notebooks' prose and the
README, and names the examples import from a `dali_fastai` module (visible code cells of the notebooks, the README's
code blocks). A reader who sees `read_coco` in the docs finds it after `from dali_fastai.all import *`."""
import ast, importlib, json, pkgutil, re
from pathlib import Path

import dali_fastai
import dali_fastai.all as everything

ROOT = Path(__file__).resolve().parents[1]
# Names the docs use that stay in their modules on purpose. Common words that a star import would shadow in a user's
# notebook (`grayscale` is fastai's own name too): DALI graph pieces, imported from their modules where graphs are
# built. And the command line's functions, `dali_fastai.training`'s (what `dali-fastai train` runs) and `dali_fastai.cli`'s:
# importing `dali_fastai.cli` sets the command's warning filters for the process.
KEPT_IN_MODULES = {'augment', 'warp', 'normalize', 'lighting', 'maybe', 'shuffled', 'grayscale',
                   'train', 'train_detection', 'train_segmentation', 'as_flags', 'fit_and_report'}
# Modules whose names stay there: the bench's optional peers (kornia, torchvision's transforms), which the library never
# imports (`pip install 'dali-fastai[bench]'`), and the map of the package's own modules (`architecture`: `cycles`,
# `rightward`, `LAYERS`), for its contributors, whose generic names a user's star import should not get
KEPT_MODULES = {'peers', 'architecture'}


def ours()->dict:
    "Each public name of a `dali_fastai` module (its `__all__`) -> the modules that define it"
    res = {}
    for m in pkgutil.iter_modules(dali_fastai.__path__):
        if m.name.startswith('_') or m.name == 'all': continue
        for n in importlib.import_module(f'dali_fastai.{m.name}').__all__: res.setdefault(n, []).append(m.name)
    return res


def backticked(md:str)->set:
    "The leading identifier of each `code span` of markdown (`DaliDataLoaders.from_dblock` -> DaliDataLoaders)"
    return {m.group(0) for span in re.findall(r'`([^`\n]+)`', md) if (m := re.match(r'[A-Za-z_]\w*', span))}


def imported(code:str)->set:
    "Names a code cell or block imports from `dali_fastai` modules (`from dali_fastai.x import a, b`)"
    try: tree = ast.parse('\n'.join(l for l in code.splitlines() if not l.lstrip().startswith(('%', '!'))))
    except SyntaxError: return set()
    return {a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and (node.module or '').startswith('dali_fastai')
            for a in node.names if a.name != '*'}


def doc_names()->dict:
    "Each name the docs use -> where: notebooks' markdown and visible example cells, the README's prose and code blocks"
    res = {}
    def add(names, where):
        for n in names: res.setdefault(n, set()).add(where)
    for nb in sorted((ROOT/'nbs').glob('*.ipynb')):
        for c in json.loads(nb.read_text())['cells']:
            src = ''.join(c['source'])
            if c['cell_type'] == 'markdown': add(backticked(src), nb.name)
            elif c['cell_type'] == 'code' and not re.search(r'^#\|\s*(hide|export)', src, re.M): add(imported(src), nb.name)
    readme = (ROOT/'README.md').read_text()
    add(backticked(re.sub(r'```.*?```', '', readme, flags=re.S)), 'README.md')
    for block in re.findall(r'```python\n(.*?)```', readme, flags=re.S): add(imported(block), 'README.md')
    return res


def test_parsers():
    assert backticked("`read_coco` and `DaliDataLoaders.from_dblock(dblock, path)`, not read_voc") == {'read_coco', 'DaliDataLoaders'}
    assert imported("from dali_fastai.annotations import read_coco\nfrom dali_fastai.data import (DaliDataLoaders,\n  dblock_items)\n"
                    "from fastai.vision.all import Resize\n%time x = 1") == {'read_coco', 'DaliDataLoaders', 'dblock_items'}


def test_docs_names_come_from_all():
    have,docs = set(everything.__all__),doc_names()
    missing = {n: (ours()[n], sorted(docs[n])) for n in docs if n in ours() and n not in have and n not in KEPT_IN_MODULES
               and not set(ours()[n]) <= KEPT_MODULES}
    assert not missing, f"names the docs use that `from dali_fastai.all import *` does not give (name: modules, used in): {missing}"
    assert 'read_coco' in docs and 'read_coco' in have
    ns = {}
    exec('from dali_fastai.all import *', ns)
    for n in everything.__all__:
        assert ns[n] is getattr(importlib.import_module(f'dali_fastai.{ours()[n][0]}'), n), n  # the module's own object


def test_kept_names_are_ours_and_kept():
    "The exceptions do not rot: each is a name of ours, and `all` does not give it"
    assert KEPT_IN_MODULES <= set(ours()) and not KEPT_IN_MODULES & set(everything.__all__)


def test_import_hides_fastais_jit_warning_only():
    "In a fresh process, `import dali_fastai.all` shows no `torch.jit.script` deprecation (fastai's), and the filter does not outlive the import"
    import subprocess, sys
    code = ("import warnings\nimport dali_fastai.all\n"
            "print(any(f[1] is not None and 'jit' in f[1].pattern for f in warnings.filters))")
    r = subprocess.run([sys.executable, '-W', 'always', '-c', code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert 'torch.jit.script' not in r.stderr, r.stderr
    assert r.stdout.strip() == 'False'  # no filter left behind
