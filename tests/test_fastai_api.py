"""The one-line change: `DaliDataLoaders.from_dblock(dblock, path)` instead of `dblock.dataloaders(path)`, and everything
after it as with fastai's loaders: vision_learner (its Normalize compiled into DALI), lr_find, fit_one_cycle, show_batch,
show_results, get_preds, tta, predict (paths, PIL images, arrays, bytes), export/load_learner, Interpretation; fastai
transforms with no DALI equivalent run after DALI with fastai's split_idx semantics."""
import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch
from fastai.vision.all import (DataBlock, ImageBlock, CategoryBlock, MultiCategoryBlock, get_image_files, parent_label,
                               GrandparentSplitter, RandomResizedCrop, Resize, aug_transforms, vision_learner, resnet18,
                               accuracy, accuracy_multi, Normalize, imagenet_stats, load_learner, PILImage,
                               Interpretation, TensorMultiCategory, TensorCategory, RandomErasing, Transform, TensorImage)
from PIL import Image

from dali_fastai.data import DaliDataLoaders
from dali_fastai.loader import DaliNormalize
from helpers import fmnist_path

TAGS = {'T-shirt_top': 'top short', 'Trouser': 'bottom long', 'Pullover': 'top long warm', 'Dress': 'top bottom',
        'Coat': 'top long warm', 'Sandal': 'footwear open', 'Shirt': 'top long', 'Sneaker': 'footwear',
        'Bag': 'accessory', 'Ankle_boot': 'footwear warm'}


def tags(p): return TAGS[p.parent.name].split()


@pytest.fixture(scope='module')
def learn(tmp_path_factory):
    "The issue's example: multi-label DataBlock, RandomResizedCrop + aug_transforms, vision_learner, one epoch"
    torch.manual_seed(0)
    dblock = DataBlock(blocks=(ImageBlock, MultiCategoryBlock), get_items=get_image_files, get_y=tags,
                       splitter=GrandparentSplitter(), item_tfms=RandomResizedCrop(32, min_scale=0.35),
                       batch_tfms=aug_transforms())
    dls = DaliDataLoaders.from_dblock(dblock, fmnist_path(), bs=64, device='cpu', seed=0)
    learn = vision_learner(dls, resnet18, pretrained=False, metrics=accuracy_multi, path=tmp_path_factory.mktemp('m'))
    with learn.no_bar(), learn.no_logging(): learn.fit_one_cycle(1, 3e-3)
    return learn


def test_what_runs_where(learn):
    report = learn.dls.summary(show=False)
    for compiled in ('RandomResizedCrop', 'Flip', 'Rotate', 'Zoom', 'Warp', 'Brightness', 'Contrast', 'WarpPerspective'):
        assert compiled in report, compiled
    valid = report[report.index('valid:'):]
    assert 'Brightness' in valid and 'skipped (train only)' in valid
    assert 'WarpPerspective' not in valid, "validation does not resample: fastai's affine transforms are train-only"


def test_batches_and_loss(learn):
    dls = learn.dls
    xb,yb = dls.one_batch()
    assert (xb.shape, type(yb), yb.dtype, yb.shape) == ((64, 3, 32, 32), TensorMultiCategory, torch.float32, (64, dls.c))
    assert type(learn.loss_func).__name__ == 'BCEWithLogitsLossFlat' and dls.c == 8
    y = dls.valid.items.targets[0].values
    trivial = torch.maximum(y.mean(0), 1 - y.mean(0)).mean().item()
    assert learn.recorder.values[-1][2] > trivial, "one epoch beats predicting each tag's commoner value"


def test_no_normalize_unless_asked(tmp_path):
    "from_dblock normalizes only when asked, as fastai; Normalize added later (vision_learner's pretrained stats) is compiled into DALI"
    dblock = DataBlock(blocks=(ImageBlock, CategoryBlock), get_items=get_image_files, get_y=parent_label,
                       splitter=GrandparentSplitter(), item_tfms=Resize(16))
    dls = DaliDataLoaders.from_dblock(dblock, fmnist_path(), bs=32, device='cpu')
    x0 = dls.valid.one_batch()[0]
    assert 0 <= x0.min() and x0.max() <= 1 and not dls.after_batch.fs, "0..1 floats, as fastai's IntToFloatTensor"
    dls.add_tfms([Normalize.from_stats(*imagenet_stats)], 'after_batch')
    x1 = dls.valid.one_batch()[0]
    m,s = [torch.tensor(v).view(1, 3, 1, 1) for v in imagenet_stats]
    assert torch.allclose(x1, (x0 - m)/s, atol=1e-4), "normalized once, by DALI"
    assert [type(t) for t in dls.train.after_batch.fs] == [DaliNormalize] == [type(t) for t in dls.valid.after_batch.fs]
    assert torch.allclose(dls.valid.decode((x1,))[0], x0, atol=1e-4)


def test_preds_tta_predict(learn, tmp_path):
    preds,targs = learn.get_preds()
    assert preds.shape == targs.shape == (1000, 8)
    assert torch.equal(targs, learn.dls.valid.items.targets[0].values)
    with learn.no_bar():
        (aug,same),t2 = learn.tta(n=2, beta=None)  # beta=None: the augmented passes' mean and the plain pass, which must be get_preds'
    assert torch.allclose(same, preds, atol=1e-5) and torch.equal(t2, targs)
    assert not torch.allclose(aug, preds, atol=1e-3), "tta's passes read the validation items through the training transforms"
    acc = lambda p: ((p > 0.5) == targs.bool()).float().mean().item()
    assert abs(acc(aug) - acc(preds)) < 0.1

    f = learn.dls.valid.items.files[7]
    want = preds[7]
    for item in (f, str(f), PILImage.create(f), np.asarray(Image.open(f).convert('RGB')), f.read_bytes()):
        with learn.no_bar(): dec,_,probs = learn.predict(item)
        assert torch.allclose(probs, want, atol=2e-2 if isinstance(item, np.ndarray) else 1e-4), type(item)
        assert list(dec) == [learn.dls.vocab[i] for i in torch.where(want > 0.5)[0]]

    learn.export(tmp_path/'m.pkl')
    learn2 = load_learner(tmp_path/'m.pkl')
    with learn2.no_bar(): assert torch.allclose(learn2.predict(f)[2], want, atol=1e-4)


def test_show_and_interpret(learn):
    learn.dls.show_batch(max_n=4)
    assert len([a for a in plt.gcf().axes if a.get_title()]) == 4
    plt.close('all')
    learn.show_results(max_n=4)
    plt.close('all')
    interp = Interpretation.from_learner(learn)
    losses,idx = interp.top_losses(3)
    assert len(idx) == 3 and losses[0] >= losses[-1]
    interp.plot_top_losses(3)
    plt.close('all')


class AddOne(Transform):
    "A user's batch transform with no DALI equivalent, for training only"
    split_idx,order = 0,95
    def encodes(self, x:TensorImage): return x + 1


def test_leftovers_keep_split_idx():
    dblock = DataBlock(blocks=(ImageBlock, CategoryBlock), get_items=get_image_files, get_y=parent_label,
                       splitter=GrandparentSplitter(), item_tfms=Resize(16),
                       batch_tfms=[*aug_transforms(max_rotate=0., max_warp=0., max_lighting=0., min_zoom=1., max_zoom=1.,
                                                   do_flip=False), RandomErasing(p=1.)])
    dls = DaliDataLoaders.from_dblock(dblock, fmnist_path(), bs=32, device='cpu', seed=0)
    assert 'RandomErasing' in dls.summary(show=False)
    assert isinstance(dls.train.after_batch.fs[-1], RandomErasing)
    plain = DaliDataLoaders.from_dblock(dblock.new(item_tfms=Resize(16), batch_tfms=[]), fmnist_path(), bs=32, device='cpu', seed=0)
    assert torch.equal(dls.valid.one_batch()[0], plain.valid.one_batch()[0]), "a train-only leftover leaves validation alone"
    dls.add_tfms([AddOne()], 'after_batch')
    v = dls.valid.one_batch()[0]
    assert torch.equal(v, plain.valid.one_batch()[0]), "add_tfms keeps fastai's split_idx: AddOne is train-only"
    assert any(isinstance(t, AddOne) for t in dls.train.after_batch.fs)
    with pytest.raises(ValueError, match="only 'after_batch'"): dls.train.add_tfms([AddOne()], 'after_item')
