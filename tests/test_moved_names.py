"""Learners exported before one of our classes moved to another module still load.

`learn.export` pickles the loaders with what they hold (`DaliNormalize` in `after_batch`, ...), each class named by its
module's path; a learner exported before a move names the old module, which must keep giving the class. Each row of
`MOVED` is such a move: the test exports a learner now, writes the old path where the new one stands in the pickle,
loads it, and predicts as the learner did."""
import importlib, zipfile

import pytest
import torch
from fastai.learner import Learner, load_learner

from dali_fastai.data import DaliDataLoaders
from helpers import fmnist_path, fmnist_subset, tiny_model

# (class, the module learners were exported with it in, the module it is defined in now)
MOVED = [('DaliNormalize', 'loader', 'translate')]


@pytest.mark.parametrize('name,old,new', MOVED)
def test_old_path_gives_the_class(name, old, new):
    cls = getattr(importlib.import_module(f'dali_fastai.{new}'), name)
    assert cls.__module__ == f'dali_fastai.{new}'
    assert getattr(importlib.import_module(f'dali_fastai.{old}'), name) is cls


def _with_old_paths(src, dest, moved:list):
    "A copy of the exported learner `src` (torch's zip format) whose pickle names each class of `moved` by its old module"
    with zipfile.ZipFile(src) as z, zipfile.ZipFile(dest, 'w', zipfile.ZIP_STORED) as out:
        for info in z.infolist():
            data = z.read(info)
            if info.filename.endswith('/data.pkl'):
                for name,old,new in moved:
                    # pickle protocol 2 (`export`'s) names a class as a GLOBAL opcode: `c<module>\n<name>\n`
                    now,then = f'cdali_fastai.{new}\n{name}\n'.encode(),f'cdali_fastai.{old}\n{name}\n'.encode()
                    assert data.count(now) == 1, f"the exported learner does not name {name} once by dali_fastai.{new}"
                    data = data.replace(now, then)
            out.writestr(info.filename, data)


def test_learner_exported_before_the_moves_loads(tmp_path):
    files,labels = fmnist_subset(4)
    dls = DaliDataLoaders.from_lists(fmnist_path(), files, labels, valid_pct=0.25, seed=0, bs=4, size=16, device='cpu')
    torch.manual_seed(0)
    learn = Learner(dls, tiny_model(dls.c), path=tmp_path)
    learn.export('now.pkl')
    _with_old_paths(tmp_path/'now.pkl', tmp_path/'before.pkl', MOVED)
    before = load_learner(tmp_path/'before.pkl')
    for name,_,new in MOVED:
        cls = getattr(importlib.import_module(f'dali_fastai.{new}'), name)
        assert any(type(t) is cls for dl in before.dls.loaders for t in dl.after_batch.fs), name
    f = dls.valid.items.files[0]
    assert torch.allclose(before.predict(f)[2], learn.predict(f)[2], atol=1e-5)
