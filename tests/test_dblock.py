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
                               CrossEntropyLossFlat, BCEWithLogitsLossFlat, PointBlock, BBoxBlock, BBoxLblBlock, MaskBlock,
                               FuncSplitter, TensorPoint, vision_learner, resnet18)
from fastai.data.transforms import get_c
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



def test_missing_or_empty_source_says_so(tmp_path, df, monkeypatch):
    """A folder that is not there or holds no image gets `from_folder`'s errors, not fastai's `'NoneType' object is not
    iterable`; items that are not image paths (names relative to another folder) get an error saying what they must be,
    with or without skip_bad_files (leaving them out would leave nothing)"""
    dblock = DataBlock(blocks=(ImageBlock, CategoryBlock), get_items=get_image_files, get_y=parent_label)
    with pytest.raises(FileNotFoundError, match="dataset folder 'missing/path' does not exist"):
        DaliDataLoaders.from_dblock(dblock, 'missing/path', device='cpu')
    with pytest.raises(ValueError, match=f"no images in '{tmp_path}'"):
        DaliDataLoaders.from_dblock(dblock, tmp_path, device='cpu')
    names = DataBlock(blocks=(ImageBlock, CategoryBlock), get_items=lambda d: list(d['fname']), get_y=lambda f: 'a',
                      splitter=RandomSplitter(seed=0))
    monkeypatch.chdir(tmp_path)  # the names are relative to the data's folder, not this one
    for skip in (False, True):
        with pytest.raises(ValueError, match=r"none of the \d+ image paths exists .*get_items, with its get_x, must return image paths"):
            DaliDataLoaders.from_dblock(names, df, device='cpu', skip_bad_files=skip)


def test_predict_on_a_file_that_is_not_an_image(tmp_path):
    "predict and test_dl take no skip_bad_files: their error says what to pass them instead"
    dls = DaliDataLoaders.from_folder(fmnist_path(), bs=16, size=28, device='cpu', seed=0)
    learn = vision_learner(dls, resnet18, pretrained=False)
    text = tmp_path/'not_an_image.jpg'
    text.write_text('hello')
    for call in (lambda: learn.predict(text), lambda: dls.test_dl([text])):
        with pytest.raises(ValueError) as e: call()
        assert 'not a readable image: pass predict or test_dl an image file' in str(e.value) and 'skip_bad_files' not in str(e.value)

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


# --- `c` of every target kind, against fastai's loaders for the same DataBlock ---
@pytest.fixture(scope='module')
def tiny(tmp_path_factory):
    "Ten 40x32 images, `train_0` .. `train_7` and `valid_8`, `valid_9`, each with a mask of 3 codes"
    root = tmp_path_factory.mktemp('tiny')
    rng = np.random.default_rng(0)
    for i in range(10):
        Image.fromarray(rng.integers(0, 256, (32, 40, 3), dtype=np.uint8)).save(root/f"{'valid' if i >= 8 else 'train'}_{i}.png")
        Image.fromarray(rng.integers(0, 3, (32, 40), dtype=np.uint8)).save(root/f'mask_{i}.png')
    return root

def _n(o)->int: return int(o.stem.split('_')[1])
def _boxes(first:int):
    "Boxes: `first` of them on `train_0` (fastai's `c` counts the first training item's), one or two on the others"
    return lambda o: [[1., 2., 10., 20.], [5., 5., 30., 25.], [20., 3., 39., 30.]][:first if _n(o) == 0 else 1 + _n(o) % 2]

KINDS = {  # (blocks, get_y)
    'categories': ((CategoryBlock,), lambda o: 'ab'[_n(o) % 2]),
    'multi-label': ((MultiCategoryBlock,), lambda o: ['a', 'b', 'c'][:1 + _n(o) % 3]),
    'regression': ((RegressionBlock,), lambda o: float(_n(o))),
    'regression, 2 outputs': ((RegressionBlock(n_out=2),), lambda o: [float(_n(o)), 1.]),
    'points': ((PointBlock,), lambda o: [[3., 4.], [10., 20.], [30., 2.]]),
    'boxes': ((BBoxBlock, BBoxLblBlock), [_boxes(2), lambda o: ['a', 'b', 'c'][:len(_boxes(2)(o))]]),
    'boxes, none on the first': ((BBoxBlock, BBoxLblBlock), [_boxes(0), lambda o: ['a', 'b', 'c'][:len(_boxes(0)(o))]]),
    'masks': ((MaskBlock(['x', 'y', 'z']),), lambda o: o.parent/f'mask_{_n(o)}.png'),
}

@pytest.mark.parametrize('kind', list(KINDS))
def test_c_is_fastais(tiny, kind):
    "`dls.c` is what fastai's `get_c` finds on its own loaders (what `vision_learner`/`unet_learner` size the head by); `get_c` of ours agrees"
    blocks,get_y = KINDS[kind]
    dblock = DataBlock(blocks=(ImageBlock, *blocks), get_items=lambda d: sorted(d.glob('[tv]*.png')), get_y=get_y, n_inp=1,
                       splitter=FuncSplitter(lambda o: o.name.startswith('valid')), item_tfms=Resize(32))
    theirs = dblock.dataloaders(tiny, bs=2, num_workers=0)
    ours = DaliDataLoaders.from_dblock(dblock, tiny, bs=2, device='cpu', seed=0)
    want = get_c(theirs)
    assert want > 0 and (ours.c, get_c(ours)) == (want, want)
    if hasattr(theirs, 'c'): assert ours.c == theirs.c  # where fastai's loaders answer `c` themselves


def test_keypoints_reach_a_learner(tiny):
    "`vision_learner(dls, resnet18, y_range=(-1, 1))` on point loaders: a head of points x 2 outputs, a fit, a prediction of points"
    dblock = DataBlock(blocks=(ImageBlock, PointBlock), get_items=lambda d: sorted(d.glob('[tv]*.png')),
                       get_y=lambda o: [[3., 4.], [30., 20.]], splitter=FuncSplitter(lambda o: o.name.startswith('valid')),
                       item_tfms=Resize(32))
    dls = DaliDataLoaders.from_dblock(dblock, tiny, bs=2, device='cpu', seed=0)
    learn = vision_learner(dls, resnet18, y_range=(-1, 1), pretrained=False)
    with learn.no_bar(), learn.no_logging(): learn.fit(1, 1e-3)
    preds,targs = learn.get_preds()
    assert (preds.shape, targs.shape) == ((2, 4), (2, 2, 2)) and preds.abs().max() <= 1
    with learn.no_bar(): pts,_,_ = learn.predict(dls.valid.items.files[0])
    assert isinstance(pts, TensorPoint) and pts.shape == (2, 2)


def test_a_target_value_is_encoded_once_as_it_is_typed():
    "`_encoded` runs the type transforms once a distinct hashable value of a type (1 and 1.0 apart), and each unhashable one (a list of labels) every time"
    from dali_fastai.blocks import _encoded
    seen = []
    def types(v): seen.append(v); return torch.tensor(v)
    out = _encoded(lambda r: r['y'], types, [{'y': 1}, {'y': 1.0}, {'y': 1}, {'y': [1, 2]}, {'y': [1, 2]}])
    assert seen == [1, 1.0, [1, 2], [1, 2]] and [type(v) for v in seen[:2]] == [int, float]
    assert out[0] is out[2] and out[0].dtype == torch.long and out[1].dtype == torch.float32
