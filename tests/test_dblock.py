"""`DaliDataLoaders.from_dblock` against fastai's own `dblock.dataloaders` on the same DataBlock: the same items, split,
vocab and targets for single-label, multi-label and regression blocks, with fastai's getters and splitters; and a
`Learner` that learns each kind of target from DALI's batches."""
import numpy as np
import pandas as pd
import pytest
import torch
from fastai.vision.all import (DataBlock, ImageBlock, CategoryBlock, MultiCategoryBlock, RegressionBlock, ColReader,
                               RegexLabeller, RandomSplitter, GrandparentSplitter, ColSplitter, get_image_files,
                               parent_label, Resize, TensorCategory, TensorMultiCategory, Learner, accuracy_multi,
                               CrossEntropyLossFlat, BCEWithLogitsLossFlat)
from PIL import Image

from dali_fastai.data import DaliDataLoaders
from dali_fastai.datasets import FASHION_MNIST_CLASSES
from helpers import fmnist_path

TAGS = {'T-shirt_top': 'top short', 'Trouser': 'bottom long', 'Pullover': 'top long warm', 'Dress': 'top bottom',
        'Coat': 'top long warm', 'Sandal': 'footwear open', 'Shirt': 'top long', 'Sneaker': 'footwear',
        'Bag': 'accessory', 'Ankle_boot': 'footwear warm'}


@pytest.fixture(scope='module')
def df():
    "Fashion-MNIST files with a class, multi-label tags and a continuous target (mean brightness), and a valid column"
    root = fmnist_path()
    files = sorted(get_image_files(root))
    assert {f.parent.name for f in files} == set(TAGS) == set(FASHION_MNIST_CLASSES)
    return pd.DataFrame({'fname': [str(f.relative_to(root)) for f in files], 'label': [f.parent.name for f in files],
                         'tags': [TAGS[f.parent.name] for f in files],
                         'brightness': [float(np.asarray(Image.open(f)).mean()/255) for f in files],
                         'is_valid': [f.parent.parent.name == 'valid' for f in files]})


def same_as_fastai(dblock, source, **kw):
    "Our loaders and fastai's for `dblock`: the same files, targets and vocab in each split; returns ours"
    ours = DaliDataLoaders.from_dblock(dblock, source, bs=16, device='cpu', seed=0, **kw)
    theirs = dblock.dataloaders(source, bs=16, num_workers=0)
    get_x = dblock.getters[0] if dblock.getters[0] is not None else (lambda o: o)
    for dl,ds in zip(ours.loaders, (theirs.train_ds, theirs.valid_ds)):
        raw = [ds.items.iloc[i] if hasattr(ds.items, 'iloc') else ds.items[i] for i in range(len(ds))]
        assert [str(f) for f in dl.items.files] == [str(get_x(o)) for o in raw]
        want = torch.stack([ds.tls[1][i] for i in range(len(ds))])
        assert torch.equal(dl.items.targets[0].values, want)
    assert ours.vocab == getattr(theirs, 'vocab', None)
    assert ours.c == theirs.c
    return ours


def test_single_label_folders():
    path = fmnist_path()
    dblock = DataBlock(blocks=(ImageBlock, CategoryBlock), get_items=get_image_files, get_y=parent_label,
                       splitter=GrandparentSplitter(), item_tfms=Resize(16))
    dls = same_as_fastai(dblock, path)
    assert (len(dls.train_ds), len(dls.valid_ds)) == (3000, 1000)
    xb,yb = dls.valid.one_batch()
    assert (type(yb), yb.shape, xb.shape) == (TensorCategory, (16,), (16, 3, 16, 16))


def test_single_label_regex_random_split(df):
    path = fmnist_path()
    # the label is a regular expression on the row's file name: fastai's get_y is given the DataFrame row
    dblock = DataBlock(blocks=(ImageBlock, CategoryBlock), get_x=ColReader('fname', pref=f'{path}/'),
                       get_y=lambda r: RegexLabeller(r'/([^/]+)/[^/]+$')(r['fname']),
                       splitter=RandomSplitter(0.25, seed=1), item_tfms=Resize(16))
    dls = same_as_fastai(dblock, df)
    assert len(dls.valid_ds) == 1000


def test_multi_label(df):
    path = fmnist_path()
    dblock = DataBlock(blocks=(ImageBlock, MultiCategoryBlock), get_x=ColReader('fname', pref=f'{path}/'),
                       get_y=ColReader('tags', label_delim=' '), splitter=ColSplitter('is_valid'), item_tfms=Resize(16))
    dls = same_as_fastai(dblock, df)
    xb,yb = dls.train.one_batch()
    assert (type(yb), yb.dtype, yb.shape) == (TensorMultiCategory, torch.float32, (16, len(dls.vocab)))
    assert isinstance(dls.loss_func, BCEWithLogitsLossFlat)


def test_regression(df):
    path = fmnist_path()
    dblock = DataBlock(blocks=(ImageBlock, RegressionBlock), get_x=ColReader('fname', pref=f'{path}/'),
                       get_y=ColReader('brightness'), splitter=ColSplitter('is_valid'), item_tfms=Resize(16))
    dls = same_as_fastai(dblock, df)
    xb,yb = dls.valid.one_batch()
    assert (yb.dtype, yb.shape) == (torch.float32, (16,))
    assert type(dls.loss_func.func).__name__ == 'MSELoss'


def test_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match='reads one image input'):
        DaliDataLoaders.from_dblock(DataBlock(blocks=(CategoryBlock, CategoryBlock)), [1, 2, 3])
    with pytest.raises(TypeError, match='from_dblock'):
        DaliDataLoaders.from_dsets([1], [2])


def small_cnn(c):
    "A small convolutional model that learns Fashion-MNIST well above chance in one or two CPU epochs"
    from torch import nn
    return nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, stride=2, padding=1),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, c))


def test_learners_learn_each_target(df, tmp_path):
    "Multi-label tags and brightness regression, trained from DALI's batches, beat the trivial predictors clearly"
    path = fmnist_path()
    torch.manual_seed(0)
    common = dict(get_x=ColReader('fname', pref=f'{path}/'), splitter=ColSplitter('is_valid'), item_tfms=Resize(28))
    mdls = DaliDataLoaders.from_dblock(DataBlock(blocks=(ImageBlock, MultiCategoryBlock), get_y=ColReader('tags', label_delim=' '),
                                                 **common), df, bs=64, device='cpu', seed=0)
    learn = Learner(mdls, small_cnn(mdls.c), metrics=accuracy_multi, path=tmp_path)
    with learn.no_bar(), learn.no_logging(): learn.fit_one_cycle(3, 1e-2)
    y = mdls.valid.items.targets[0].values
    trivial = torch.maximum(y.mean(0), 1 - y.mean(0)).mean().item()  # each tag's commoner value, always
    acc = learn.recorder.values[-1][2]
    assert acc > trivial + 0.05, f"multi-label accuracy {acc:.3f}, predicting each tag's commoner value gives {trivial:.3f}"

    rdls = DaliDataLoaders.from_dblock(DataBlock(blocks=(ImageBlock, RegressionBlock), get_y=ColReader('brightness'), **common),
                                       df, bs=64, device='cpu', seed=0)
    learn = Learner(rdls, small_cnn(1), loss_func=rdls.loss_func, path=tmp_path)
    with learn.no_bar(), learn.no_logging(): learn.fit_one_cycle(3, 1e-2)
    y = rdls.valid.items.targets[0].values
    preds,targs = learn.get_preds()
    mse,var = ((preds.squeeze(-1) - targs)**2).mean().item(),y.var().item()
    assert mse < 0.5*var, f"regression MSE {mse:.5f}, predicting the mean gives {var:.5f}"


def test_image_targets_are_refused_with_a_clear_error(tmp_path):
    "An image target (image to image) is not read by DALI: a clear error that says so, before any target image is opened"
    from fastai.vision.all import FuncSplitter
    dblock = DataBlock(blocks=(ImageBlock, ImageBlock), get_items=lambda d: [d/'a.png', d/'b.png'],
                       get_y=lambda o: o.parent/'no_such_image.png', splitter=FuncSplitter(lambda o: o.name == 'b.png'))
    with pytest.raises(ValueError, match=r'an image target \(an ImageBlock after the input.*use dblock.dataloaders'):
        DaliDataLoaders.from_dblock(dblock, tmp_path, bs=1, device='cpu')
