"""`DaliDataLoaders` with a real fastai `vision_learner` (resnet18, random init) on the embedded Fashion-MNIST.

The full training (2 epochs, 3,000 images) runs once, in `test_trained_learner`: splitting its checks into tests would
train once per pytest-xdist worker. The other tests use a 300-image subset."""
import math

import numpy as np

import matplotlib
matplotlib.use('Agg')
import matplotlib.pyplot as plt
import pytest
import torch
from fastai.callback.core import Callback, CancelFitException
from fastai.callback.schedule import fit_one_cycle, lr_find, valley  # noqa: F401 (add Learner.fit_one_cycle and lr_find)
from fastai.data.transforms import Normalize
from fastai.learner import load_learner
from fastai.metrics import accuracy
from fastai.vision.learner import vision_learner, model_meta
from torchvision.models import resnet18

from dali_fastai.loader import DaliNormalize
from dali_fastai.data import DaliDataLoaders
from helpers import fmnist_path, fmnist_subset

SIZE = 28


class Count(Callback):
    "Count the batches of every training and validation phase, and record the validation targets"
    order = -5
    def before_fit(self): self.n_train,self.n_valid,self.targets = [],[],[]
    def before_train(self): self.n_train.append(0)
    def before_validate(self): self.n_valid.append(0); self.targets.append([])
    def before_batch(self):
        if self.training: self.n_train[-1] += 1
        else:
            self.n_valid[-1] += 1
            if self.yb: self.targets[-1].extend(self.y.tolist())  # predict and summary have no targets


class CancelAfter(Callback):
    "Cancel the fit after `n` training batches"
    def __init__(self, n): self.n = n
    def after_batch(self):
        if self.training and self.iter + 1 == self.n: raise CancelFitException()


def counter(learn): return learn.cbs.filter(lambda cb: isinstance(cb, Count))[0]


def normalizes(dls): return [t for t in dls.after_batch.fs if isinstance(t, Normalize)]


def titles(fig): return [ax.get_title() for ax in fig.axes if ax.get_title()]


@pytest.fixture(scope='module')
def small_dls():
    "300 Fashion-MNIST training images (30 a class), split 240/60"
    files,labels = fmnist_subset(30)
    return DaliDataLoaders.from_lists(fmnist_path(), files, labels, valid_pct=0.2, seed=0, bs=32, size=SIZE,
                                      device='cpu')


@pytest.fixture
def small_learner(small_dls, tmp_path):
    "A resnet18 over `small_dls`; `path` in a temporary folder so lr_find's and save's files stay out of the dataset"
    torch.manual_seed(0)
    return vision_learner(small_dls, resnet18, metrics=accuracy, pretrained=False, path=tmp_path, cbs=Count())


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close('all')


def test_show_batch(small_dls):
    small_dls.show_batch(max_n=6, nrows=2)
    fig = plt.gcf()
    assert len(fig.axes) == 6
    ts = titles(fig)
    assert len(ts) == 6 and set(ts) <= set(small_dls.vocab), ts
    assert all(ax.get_images() for ax in fig.axes), "every axis shows an image"
    plt.close('all')
    small_dls.valid.show_batch()  # 9 by default; valid is in order, so the titles are the first 9 labels
    _,y = small_dls.valid.one_batch()
    assert titles(plt.gcf()) == [small_dls.vocab[i] for i in y[:9]]
    plt.close('all')
    small_dls.show_batch(unique=True, max_n=4)  # one image, augmented 4 times
    assert len(set(titles(plt.gcf()))) == 1


def test_lr_find_then_fit_one_cycle(small_learner):
    learn,dls = small_learner,small_learner.dls
    with learn.no_bar(): res = learn.lr_find(num_it=20)
    assert plt.gcf().axes, "lr_find plots"
    # fastai's LR finder, batch by batch: lr = 1e-7·(10/1e-7)^(i/num_it), one batch each, until num_it or divergence
    lrs,losses = learn.recorder.lrs,learn.recorder.losses
    n = sum(counter(learn).n_train)
    assert len(lrs) == n and 6 <= n <= 20, f"{n} batches: lr_find stops after num_it (or on divergence)"
    assert n == 20 or losses[-1] > 4*min(losses), "stopped early without diverging"
    np.testing.assert_allclose(lrs, [1e-7*(10/1e-7)**(i/20) for i in range(n)], rtol=1e-5)
    # the suggestion is fastai's valley of these very losses
    expected,_ = valley(torch.tensor(lrs[2:-5]), torch.tensor(losses[2:-5]), 20)
    assert res.valley == pytest.approx(expected, rel=1e-6)
    with learn.no_bar(): learn.fit_one_cycle(1, res.valley)
    c = counter(learn)
    assert c.n_train == [len(dls.train)], "the train epoch after lr_find's abandoned one is whole"
    assert c.n_valid == [len(dls.valid)]
    assert c.targets == [dls.valid_ds.labels]


def test_fine_tune_after_lr_find(small_learner):
    "The quick start's `lr_find(); fine_tune(...)`: every phase of the frozen and the unfrozen fit is whole"
    learn,dls = small_learner,small_learner.dls
    with learn.no_bar():
        learn.lr_find(num_it=10)
        learn.fine_tune(1, freeze_epochs=1)
    c = counter(learn)
    assert c.n_train == [len(dls.train)] and c.n_valid == [len(dls.valid)], "fine_tune's last fit (the unfrozen epoch)"
    assert learn.recorder.values and all(math.isfinite(v) for v in learn.recorder.values[-1])


def test_validate_after_cancelled_fit(small_learner):
    learn,dls = small_learner,small_learner.dls
    with learn.no_bar(): learn.fit(1, cbs=CancelAfter(2))
    assert counter(learn).n_train == [2] and counter(learn).n_valid == []
    with learn.no_bar(): loss,acc = learn.validate()
    # validate saw every valid item once: its numbers are those of the per-item predictions
    preds,targs,losses = learn.get_preds(with_loss=True)
    assert targs.tolist() == dls.valid_ds.labels
    assert acc == pytest.approx((preds.argmax(1) == targs).float().mean().item(), abs=1e-6)
    assert loss == pytest.approx(losses.mean().item(), rel=1e-4)
    with learn.no_bar(): learn.fit_one_cycle(1, 1e-3)
    assert counter(learn).n_train == [len(dls.train)] and counter(learn).n_valid == [len(dls.valid)]
    assert counter(learn).targets == [dls.valid_ds.labels]


def test_one_normalize(small_dls, tmp_path):
    "DALI normalizes; vision_learner must not add fastai's Normalize on top, pretrained or not"
    x0,_ = small_dls.valid.one_batch()
    assert len(normalizes(small_dls)) == 1
    vision_learner(small_dls, resnet18, pretrained=False, path=tmp_path)
    assert len(normalizes(small_dls)) == 1
    # pretrained=True is where vision_learner adds a Normalize; this arch ignores `pretrained` so nothing is downloaded
    def resnet18_no_download(pretrained=False, **kwargs): return resnet18(weights=None)
    model_meta[resnet18_no_download] = {k: v for k,v in model_meta[resnet18].items() if k != 'weights'}
    try: vision_learner(small_dls, resnet18_no_download, pretrained=True, path=tmp_path)
    finally: del model_meta[resnet18_no_download]
    assert [type(t) for t in normalizes(small_dls)] == [DaliNormalize]
    x1,_ = small_dls.valid.one_batch()
    assert torch.equal(x0, x1), "batches are normalized once"


def test_summary(small_learner):
    s = small_learner.summary()
    assert 'Total params' in s and f'32 x 3 x {SIZE} x {SIZE}' in s
    with small_learner.no_bar(): small_learner.fit(1)
    assert counter(small_learner).n_train == [len(small_learner.dls.train)], "summary's one_batch leaves no trace"


def test_plot_top_losses(small_learner):
    "fastai's interpretation over our valid loader: the confusion matrix and top losses of the whole valid set"
    from fastai.interpret import ClassificationInterpretation
    learn,dls = small_learner,small_learner.dls
    with learn.no_bar():
        preds,targs,losses = learn.get_preds(with_loss=True)
        interp = ClassificationInterpretation.from_learner(learn)
        cm = interp.confusion_matrix()
        interp.plot_confusion_matrix()
        interp.plot_top_losses(4)
    expected = np.zeros((dls.c, dls.c), dtype=int)
    np.add.at(expected, (targs.numpy(), preds.argmax(1).numpy()), 1)
    np.testing.assert_array_equal(cm, expected)
    assert cm.sum() == len(dls.valid_ds) and cm.sum(1).tolist() == np.bincount(dls.valid_ds.labels, minlength=dls.c).tolist()
    top,idx = interp.top_losses(4)
    np.testing.assert_allclose(top, losses.sort(descending=True).values[:4], rtol=1e-4)
    ts = titles(plt.gcf())
    assert len(ts) == 4
    # fastai's titles: "prediction/actual / loss / probability", for the items with the top losses
    assert [t.split(' / ')[0] for t in ts] == [f"{dls.vocab[preds[i].argmax()]}/{dls.vocab[dls.valid_ds.labels[i]]}"
                                                for i in idx], ts


def test_tta(small_learner):
    "fastai's tta: the validation items in order through the training augmentation, blended with the plain pass"
    with small_learner.no_bar():
        preds,targs = small_learner.get_preds()
        plain,t1 = small_learner.tta(n=2, beta=1.)  # only the plain pass: get_preds' predictions
        aug,t2 = small_learner.tta(n=2, beta=0.)  # only the augmented passes
        mixed,_ = small_learner.tta(n=2)
    assert preds.shape == (len(small_learner.dls.valid_ds), 10)
    assert targs.tolist() == t1.tolist() == t2.tolist() == small_learner.dls.valid_ds.labels
    assert torch.allclose(plain, preds, atol=1e-5)
    assert not torch.allclose(aug, preds, atol=1e-3), "the augmented passes see augmented images"
    assert mixed.shape == preds.shape


def test_trained_learner(tmp_path):
    torch.manual_seed(0)  # the model's initial weights: the loaders are seeded below
    dls = DaliDataLoaders.from_folder(fmnist_path(), bs=64, size=SIZE, device='cpu', seed=0)
    assert (len(dls.train_ds), len(dls.valid_ds), dls.c) == (3000, 1000, 10)
    learn = vision_learner(dls, resnet18, metrics=accuracy, pretrained=False, path=tmp_path, cbs=Count())
    assert len(normalizes(dls)) == 1

    with learn.no_bar(): learn.fit_one_cycle(1, 3e-3)
    c = counter(learn)
    assert c.n_train == [len(dls.train)] == [3000//64], "fastai's schedule relies on len(dl) being exact"
    assert c.n_valid == [len(dls.valid)] == [-(-1000//64)]
    acc = learn.recorder.values[-1][2]
    assert acc >= 0.4, f"accuracy {acc:.3f} after 1 epoch: 10 classes, chance is 0.1"

    # get_preds: one prediction per valid item, in item order
    preds,targs = learn.get_preds()
    assert preds.shape == (1000, 10)
    assert targs.tolist() == dls.valid_ds.labels
    assert abs((preds.argmax(1) == targs).float().mean().item() - acc) < 1e-6

    # show_results: target and prediction over every image (fastai asks for a shuffled valid batch)
    learn.show_results(max_n=4)
    ts = titles(plt.gcf())
    assert len(ts) == 4 and all(len(t.split('\n')) == 2 and set(t.split('\n')) <= set(dls.vocab) for t in ts), ts
    plt.close('all')
    learn.show_results(max_n=4, shuffle=False)
    assert [t.split('\n')[0] for t in titles(plt.gcf())] == [dls.vocab[i] for i in dls.valid_ds.labels[:4]]
    plt.close('all')

    # export, load, predict: same class as the original learner and as get_preds for the same file
    learn.export(tmp_path/'m.pkl')
    learn2 = load_learner(tmp_path/'m.pkl')
    assert learn2.dls.vocab == dls.vocab and len(learn2.dls.train_ds) == 0
    for i in (0, 1, 500, 999):
        f = dls.valid_ds.files[i]
        cls,idx,probs = learn2.predict(f)
        assert isinstance(cls, str) and cls == dls.vocab[idx]
        assert isinstance(idx, torch.Tensor) and probs.shape == (10,)
        assert abs(probs.sum().item() - 1) < 1e-4
        assert cls == learn.predict(f)[0] == dls.vocab[preds[i].argmax()], f"valid item {i}"
        assert torch.allclose(probs, preds[i], atol=1e-4)

    # the loaded learner's test_dl, with labels from the folders, gives the same predictions, in order
    files = dls.valid_ds.files[:100]
    p2,t2 = learn2.get_preds(dl=learn2.dls.test_dl(files, with_labels=True))
    assert t2.tolist() == dls.valid_ds.labels[:100]
    assert torch.allclose(p2, preds[:100], atol=1e-4)
