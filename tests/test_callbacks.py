"""The raw-iterator callbacks, judged by their effect: the learning rate and momentum fastai's scheduler really set
(`learn.recorder`), compared with the schedule fastai computes for a loader of the same `len()`, and the batches and
items an epoch after `lr_find` sees. With the callback left out, each test's setup shows the bug it guards against."""
import numpy as np
import pytest
from fastai.callback.core import Callback
from fastai.callback.schedule import combined_cos, fit_one_cycle, lr_find  # noqa: F401 (add Learner methods)
from fastai.data.core import DataLoaders
from fastai.learner import Learner
from fastai.losses import CrossEntropyLossFlat
from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

from dali_fastai.callbacks import ClampSchedPos, DaliResetCallback, UnpackDaliBatch
from dali_fastai.pipeline import valid_pipeline
from helpers import index_loader, tiny_model, MAX_INDEX

N_ITEMS,BS,LEN = 13,4,2  # the iterator yields 4 batches, its len() is 2
LR,EPOCHS = 1e-2,2


class OverlongIterator(DALIGenericIterator):
    "Like the article's iterator (its `len()` is `int(size/bs)`, one short), two batches short: 2 of the 4 it yields"
    def __len__(self): return self.size // self.batch_size - 1


def overlong_iterator(files, auto_reset=True):
    pipe = valid_pipeline(files, list(range(len(files))), bs=BS, size=8)
    return OverlongIterator([pipe], ['data', 'label'], reader_name='Reader', auto_reset=auto_reset,
                            last_batch_policy=LastBatchPolicy.PARTIAL)


class Seen(Callback):
    "The items of every training epoch"
    order = 10  # after UnpackDaliBatch
    def before_fit(self): self.epochs = []
    def before_train(self): self.epochs.append([])
    def before_batch(self):
        if self.training: self.epochs[-1] += self.yb[0].tolist()


def learner(files, tmp_path, *cbs, auto_reset=True):
    dls = DataLoaders(overlong_iterator(files, auto_reset), overlong_iterator(files))
    return Learner(dls, tiny_model(MAX_INDEX), loss_func=CrossEntropyLossFlat(), path=tmp_path,
                   cbs=[UnpackDaliBatch(), Seen(), *cbs])


def one_cycle(learn):
    "`fit_one_cycle`: the learning rates and momentums fastai's scheduler set, batch by batch"
    with learn.no_bar(), learn.no_logging(): learn.fit_one_cycle(EPOCHS, LR)
    return np.array(learn.recorder.lrs),np.array(learn.recorder.hps['mom'])


@pytest.fixture(scope='module')
def reference(files, tmp_path_factory):
    "fastai's own schedule for a loader of the same len() that yields exactly len() batches (a DaliDataLoader)"
    train = index_loader(files[:LEN*BS], BS, train=True, seed=0)
    assert len(train) == LEN
    dls = DataLoaders(train, index_loader(files[:BS], BS), device='cpu')
    return one_cycle(Learner(dls, tiny_model(MAX_INDEX), loss_func=CrossEntropyLossFlat(), path=tmp_path_factory.mktemp('ref')))


def expected_clamped(per_epoch=BS):
    "Per batch, fastai's one-cycle lr and momentum at the position ClampSchedPos promises: within the epoch's share"
    lr,mom = combined_cos(0.25, LR/25, LR, LR/1e5),combined_cos(0.25, 0.95, 0.85, 0.95)
    pos = [min(e/EPOCHS + i/(LEN*EPOCHS), (e + 1)/EPOCHS - 1e-7) for e in range(EPOCHS) for i in range(per_epoch)]
    return np.array([lr(p) for p in pos]),np.array([mom(p) for p in pos])


def test_clamp_sched_pos_keeps_fastais_schedule(files, tmp_path, reference):
    lrs,moms = one_cycle(learner(files[:N_ITEMS], tmp_path, DaliResetCallback(), ClampSchedPos()))
    ref_lrs,ref_moms = reference
    assert len(lrs) == len(moms) == EPOCHS*BS and len(ref_lrs) == EPOCHS*LEN
    # the batches inside len() get exactly the schedule fastai computes for a loader of that len()
    for e in range(EPOCHS):
        np.testing.assert_allclose(lrs[BS*e:BS*e + LEN], ref_lrs[LEN*e:LEN*(e + 1)], rtol=1e-6, err_msg=f"epoch {e}: lr")
        np.testing.assert_allclose(moms[BS*e:BS*e + LEN], ref_moms[LEN*e:LEN*(e + 1)], rtol=1e-6, err_msg=f"epoch {e}: mom")
    # the extra batch stays at the end of its epoch's share: the article's `min(1-1e-7, pos)`, per epoch
    exp_lrs,exp_moms = expected_clamped()
    np.testing.assert_allclose(lrs, exp_lrs, rtol=1e-5)
    np.testing.assert_allclose(moms, exp_moms, rtol=1e-5)
    assert lrs[-1] < 1e-6, f"the last batch trains at {lrs[-1]:.2e}: fastai's one cycle ends at lr/1e5 = {LR/1e5:.0e}"


def test_without_clamp_the_schedule_overruns(files, tmp_path):
    "The bug the callback exists for: past its end, fastai's schedule climbs again"
    lrs,_ = one_cycle(learner(files[:N_ITEMS], tmp_path, DaliResetCallback()))
    exp_lrs,_ = expected_clamped()
    assert lrs[-1] > 100*exp_lrs[-1], f"without ClampSchedPos the last lr is {lrs[-1]:.2e}"
    assert not np.allclose(lrs[:BS], exp_lrs[:BS], rtol=1e-3), "epoch 0's extra batches eat into epoch 1's schedule"


@pytest.mark.parametrize('with_reset', [True, False], ids=['reset', 'no-reset'])
def test_reset_callback_after_lr_find(files, tmp_path, with_reset):
    "lr_find stops in mid-epoch: with DaliResetCallback the next fit's epoch is whole, every item once"
    learn = learner(files[:N_ITEMS], tmp_path, *([DaliResetCallback()] if with_reset else []))
    with learn.no_bar(): learn.lr_find(num_it=6, show_plot=False)  # 4 batches, then 2 of the next epoch
    seen = learn.cbs.filter(lambda cb: isinstance(cb, Seen))[0]
    assert [len(e) for e in seen.epochs] == [13, 8], "lr_find: a whole epoch, then 2 batches of the next"
    with learn.no_bar(), learn.no_logging(): learn.fit(2)
    if with_reset: assert [sorted(e) for e in seen.epochs] == [list(range(N_ITEMS))]*2
    else: assert sorted(seen.epochs[0]) != list(range(N_ITEMS)), "the bug: the fit continues lr_find's epoch"
