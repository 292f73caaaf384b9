"""`DaliDataLoader` edge cases: exact `len`, exactly-once epochs, whole epochs after abandoned ones, pickling,
bad input, seeds.

Items are identified by their label (the item's index) and, independently, by their colour
(see `helpers.make_index_images`)."""
import gc
import os
import pickle
import weakref

import matplotlib
matplotlib.use('Agg')
import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch
from fastai.callback.core import (Callback, CancelEpochException, CancelFitException, CancelTrainException,
                                  CancelValidException)
from fastai.callback.schedule import lr_find  # noqa: F401 (adds Learner.lr_find)
from fastai.learner import Learner
from fastai.losses import CrossEntropyLossFlat
from PIL import Image

from dali_fastai.loader import DaliDataLoader, ImageItems
from dali_fastai.data import DaliDataLoaders
from helpers import (MAX_INDEX, flat, decode_index, index_items, index_loader, epoch_items, fmnist_subset, tiny_model,
                     Items, RaiseAt, index_learner, N_TRAIN, N_VALID, BS, needs_gpu)

# ---------------------------------------------------------------- exact len, exactly once

SIZES = [*range(1, 14), 31, 64]
BATCH_SIZES = [1, 2, 3, 4, 7, 8]


@pytest.mark.parametrize('bs', BATCH_SIZES)
@pytest.mark.parametrize('n', SIZES)
def test_valid_yields_len_batches_each_item_once_in_order(files, n, bs):
    dl = index_loader(files[:n], bs)
    assert len(dl) == -(-n // bs)
    for epoch in range(2):
        batches = epoch_items(dl)
        assert len(batches) == len(dl), f"epoch {epoch}"
        assert [len(b) for b in batches] == [bs]*(n // bs) + ([n % bs] if n % bs else [])
        assert flat(batches) == list(range(n)), f"epoch {epoch}: every item once, in order"


@pytest.mark.parametrize('bs', BATCH_SIZES)
@pytest.mark.parametrize('n', SIZES)
def test_train_drop_last_yields_full_batches_no_duplicate(files, n, bs):
    dl = index_loader(files[:n], bs, train=True, seed=100*n + bs)
    assert len(dl) == n // bs
    for epoch in range(3):
        batches = epoch_items(dl)
        assert len(batches) == len(dl), f"epoch {epoch}"
        assert all(len(b) == bs for b in batches), f"epoch {epoch}: {[len(b) for b in batches]}"
        items = flat(batches)
        assert len(set(items)) == len(items), f"epoch {epoch}: an item came twice: {sorted(items)}"
        assert set(items) <= set(range(n))


@pytest.mark.parametrize('bs', BATCH_SIZES)
@pytest.mark.parametrize('n', SIZES)
def test_train_keep_last_yields_every_item_once(files, n, bs):
    dl = index_loader(files[:n], bs, train=True, drop_last=False, seed=100*n + bs)
    assert len(dl) == -(-n // bs)
    for epoch in range(3):
        batches = epoch_items(dl)
        assert len(batches) == len(dl), f"epoch {epoch}"
        assert sorted(flat(batches)) == list(range(n)), f"epoch {epoch}"
        assert all(len(b) == bs for b in batches[:-1])


def test_batch_types_and_shapes(files):
    x,y = index_loader(files[:5], 4, size=8).one_batch()
    assert type(x).__name__ == 'TensorImage' and x.dtype == torch.float32 and x.shape == (4, 3, 8, 8)
    assert type(y).__name__ == 'TensorCategory' and y.dtype == torch.long and y.shape == (4,)


# ---------------------------------------------------------------- a whole epoch after an abandoned one

def _break_after(k):
    def abandon(dl):
        for i,_ in enumerate(dl):
            if i + 1 == k: break
    return abandon

def _raise_inside(dl):
    with pytest.raises(KeyError, match='boom'):
        for i,_ in enumerate(dl):
            if i == 1: raise KeyError('boom')

def _kept_alive(dl):
    "Abandon an iterator but return it, for the caller to keep referenced (as a traceback or a variable would)"
    it = iter(dl); next(it); next(it)
    return it

def _show_batch(dl):
    dl.show_batch(max_n=2)
    plt.close('all')

ABANDON = {'one_batch': lambda dl: dl.one_batch(), 'first': lambda dl: next(iter(dl)), 'show_batch': _show_batch,
           'break_after_1': _break_after(1), 'break_after_3': _break_after(3), 'exception': _raise_inside,
           'kept_alive': _kept_alive}


def _check_whole(dl, n, epochs=2):
    for epoch in range(epochs):
        batches = epoch_items(dl)
        assert len(batches) == len(dl), f"epoch {epoch} after the abandoned one"
        if dl.shuffle: assert sorted(flat(batches)) == list(range(n))
        else: assert flat(batches) == list(range(n)), f"epoch {epoch} after the abandoned one"


@pytest.mark.parametrize('drain_limit', [100, 0], ids=['drain', 'rebuild'])
@pytest.mark.parametrize('abandon', list(ABANDON))
@pytest.mark.parametrize('train', [False, True], ids=['valid', 'train'])
def test_whole_epoch_after_abandoned_epoch(files, train, abandon, drain_limit):
    n = 23
    dl = index_loader(files[:n], 2, train=train, drop_last=False, seed=3, drain_limit=drain_limit)
    kept = []  # what an abandoning call returns stays referenced until the end
    for repeat in range(2):
        kept.append(ABANDON[abandon](dl))
        builds = dl._source.builds  # (private) the number of DALI pipelines built so far: tells drain from rebuild
        _check_whole(dl, n, epochs=1)
        if abandon in ('one_batch', 'show_batch'): continue  # they read a short-lived copy: the loader is untouched
        assert dl._source.builds == builds + (drain_limit == 0), "drain_limit chooses drain (no new pipeline) or rebuild"
    _check_whole(dl, n)


@pytest.mark.parametrize('drain_limit', [100, 0], ids=['drain', 'rebuild'])
def test_one_batch_inside_an_epoch(files, drain_limit):
    "A callback may call `one_batch()` (or `show_batch()`) while an epoch of the same loader is running"
    dl = index_loader(files[:12], 2, drain_limit=drain_limit)
    outer = []
    for i,(_,y) in enumerate(dl):
        outer.append(y.tolist())
        if i == 1: assert dl.one_batch()[1].tolist() == [0, 1]
    assert flat(outer) == list(range(12)), "the running epoch is not disturbed"
    assert flat(epoch_items(dl)) == list(range(12)), "the next epoch is whole"


@pytest.mark.parametrize('drain_limit', [100, 0], ids=['drain', 'rebuild'])
def test_abandoned_train_drop_last(files, drain_limit):
    dl = index_loader(files[:21], 4, train=True, seed=5, drain_limit=drain_limit)
    for k in (1, 2, 4):
        _break_after(k)(dl)
        batches = epoch_items(dl)
        assert [len(b) for b in batches] == [4]*5
        assert len(set(flat(batches))) == 20


# ---------------------------------------------------------------- inside a Learner

VALID_ITEMS = list(range(N_TRAIN, N_TRAIN + N_VALID))

def _assert_whole_train(items, where):
    assert len(items) == N_TRAIN and sorted(items) == list(range(N_TRAIN)), f"{where}: {sorted(items)}"


ABANDON_IN_FIT = {
    'cancel_train': (CancelTrainException, True), 'cancel_epoch': (CancelEpochException, True),
    'cancel_fit': (CancelFitException, True), 'cancel_valid': (CancelValidException, False),
    'cancel_fit_in_valid': (CancelFitException, False), 'error': (RuntimeError, True),
}


@pytest.mark.parametrize('drain_limit', [100, 0], ids=['drain', 'rebuild'])
@pytest.mark.parametrize('kind', list(ABANDON_IN_FIT))
def test_learner_epoch_after_callback_cancel(files, tmp_path, kind, drain_limit):
    exc,in_train = ABANDON_IN_FIT[kind]
    learn = index_learner(files, tmp_path, drain_limit)
    items = learn.cbs.filter(lambda cb: isinstance(cb, Items))[0]
    stop = RaiseAt(exc, n=2, in_train=in_train)
    if exc is RuntimeError:
        with pytest.raises(RuntimeError, match='raised by a test callback'): learn.fit(2, cbs=stop)
    else: learn.fit(2, cbs=stop)
    if kind in ('cancel_train', 'cancel_epoch', 'cancel_valid'):  # the fit went on: its second epoch is whole
        assert len(items.train_items) == 2
        assert len(items.train_items[0]) == (2*BS if in_train else N_TRAIN)
        _assert_whole_train(items.train_items[1], 'the epoch after the cancelled one')
        assert items.valid_items[-1] == VALID_ITEMS
    learn.fit(1)
    _assert_whole_train(items.train_items[0], 'the fit after')
    assert items.valid_items == [VALID_ITEMS]
    learn.fit(1, cbs=RaiseAt(CancelFitException, n=3, in_train=True))
    assert learn.validate() is not None
    assert items.valid_items[-1] == VALID_ITEMS, "validate() after a cancelled fit sees every valid item once, in order"


@pytest.mark.parametrize('drain_limit', [100, 0], ids=['drain', 'rebuild'])
def test_learner_fit_after_lr_find(files, tmp_path, drain_limit):
    learn = index_learner(files, tmp_path, drain_limit)
    items = learn.cbs.filter(lambda cb: isinstance(cb, Items))[0]
    builds = learn.dls.train._source.builds
    learn.lr_find(num_it=6, stop_div=False, show_plot=False)  # stops after 6 of the 10 batches
    assert len(items.train_items[0]) == 6*BS
    learn.fit(2)
    assert len(items.train_items) == 2
    for i,t in enumerate(items.train_items): _assert_whole_train(t, f'fit epoch {i} after lr_find')
    assert items.valid_items == [VALID_ITEMS]*2
    assert learn.dls.train._source.builds == builds + 1 + (drain_limit == 0)


def _threads():
    with open('/proc/self/status') as f: return int(next(l for l in f if l.startswith('Threads:')).split()[1])


@pytest.mark.skipif(not os.path.exists('/proc/self/status'), reason='reads /proc (Linux)')
def test_rebuilds_free_their_pipelines(files):
    "Every rebuild drops a DALI pipeline and its worker threads: 30 abandoned epochs leave no threads behind"
    dl = index_loader(files[:40], 2, train=True, seed=0, drain_limit=0)
    _break_after(1)(dl)
    _break_after(1)(dl)
    before = _threads()
    for _ in range(30): _break_after(1)(dl)
    assert _threads() <= before + 2, f"{_threads() - before} more threads after 30 rebuilds"
    assert sorted(flat(epoch_items(dl))) == list(range(40))


def test_batches_go_when_dropped(files):
    "A batch goes once the step has dropped it and taken the next one, as a fastai loader's does, not at the next garbage collection: on the GPU its images are DALI's own buffer (~150 MB at bs 256, 224 px), which a reference cycle would keep from DALI for many batches"
    dl = index_loader(files[:16], 4, train=True, seed=0)
    gc.collect(); gc.disable()
    try:
        held = []
        for b in dl:
            assert all(r() is None for r in held), "a batch outlived the next one (held in a reference cycle)"
            held += [weakref.ref(t) for t in b]
            del b
        assert len(held) == 2*len(dl) and all(r() is None for r in held)
    finally: gc.enable()

# ---------------------------------------------------------------- new, to, pickle

def test_new_unshuffled_keeps_every_item_in_order(files):
    dl = index_loader(files[:11], 4, train=True, seed=0)
    dl2 = dl.new(shuffle=False, drop_last=False)
    assert (dl2.shuffle, dl2.drop_last, dl2.train, dl2.bs, dl2.size) == (False, False, True, 4, 8)
    assert (dl.shuffle, dl.drop_last) == (True, True), "new() leaves the original alone"
    assert len(dl2) == 3
    for _ in range(2): assert flat(epoch_items(dl2)) == list(range(11))
    assert len(epoch_items(dl)) == 2


def test_to_cpu(files):
    dl = index_loader(files[:9], 4)
    it = iter(dl); next(it)
    assert dl.to('cpu') is dl and dl.to(torch.device('cpu')) is dl
    assert dl.device == torch.device('cpu')
    assert flat(epoch_items(dl)) == list(range(9))
    x,y = dl.one_batch()
    assert x.device.type == 'cpu' and y.device.type == 'cpu'


@pytest.mark.skipif(torch.cuda.is_available(), reason='checks the error for a GPU that is not there')
def test_to_missing_gpu_says_what_to_do(files):
    dl = index_loader(files[:9], 4)
    with pytest.raises(RuntimeError, match="device='cpu'"): dl.to('cuda')
    assert dl.device == torch.device('cpu')
    assert flat(epoch_items(dl)) == list(range(9)), "a failed move leaves the loader working"


@pytest.mark.parametrize('train', [False, True], ids=['valid', 'train'])
def test_pickle_mid_epoch(files, train):
    dl = index_loader(files[:13], 4, train=train, drop_last=False, seed=2)
    it = iter(dl)
    x,y = next(it)
    copy = pickle.loads(pickle.dumps(dl))
    assert sorted(flat(epoch_items(copy))) == list(range(13)), "the copy starts a whole epoch"
    assert sorted(flat(epoch_items(copy))) == list(range(13))
    rest = [y.tolist() for _,y in it]
    assert sorted(y.tolist() + flat(rest)) == list(range(13)), "pickling does not disturb the epoch in progress"
    assert sorted(flat(epoch_items(dl))) == list(range(13))
    if train: np.testing.assert_array_equal(copy.aug['warps'], dl.aug['warps'])


def test_pickle_dataloaders_mid_epoch(files):
    dls = DaliDataLoaders.from_splits('.', files[:20], [str(i % 3) for i in range(20)], files[20:27],
                                      [str(i % 3) for i in range(7)], bs=4, size=8, device='cpu', seed=0)
    next(iter(dls.train)); next(iter(dls.valid))
    dls2 = pickle.loads(pickle.dumps(dls))
    assert [len(b[0]) for b in dls2.train] == [4]*5
    assert [len(b[0]) for b in dls2.valid] == [4, 3]
    assert dls2.vocab == ['0', '1', '2']


# ---------------------------------------------------------------- bad input

def test_bad_bs_and_size(files):
    items = index_items(files[:5])
    for bs in (0, -1):
        with pytest.raises(ValueError, match='bs must be an int of at least 1'): DaliDataLoader(items, bs=bs, device='cpu')
    for size in (0, -4):
        with pytest.raises(ValueError, match='size must be an int or'):
            DaliDataLoader(items, bs=2, size=size, device='cpu')
    with pytest.raises(ValueError, match='bs must be an int of at least 1'):
        DaliDataLoaders.from_splits('.', files[:4], [0, 1, 0, 1], files[4:6], [0, 1], bs=0, size=8, device='cpu')
    with pytest.raises(ValueError, match='size must be an int or'):
        DaliDataLoaders.from_splits('.', files[:4], [0, 1, 0, 1], files[4:6], [0, 1], bs=2, size=0, device='cpu')


def test_bs_larger_than_the_sets(files):
    "A bs the training set cannot fill once is an error; a validation set smaller than its batch is one partial batch, as in fastai"
    with pytest.raises(ValueError, match='bs=5 is larger than the 4 training images'):
        DaliDataLoaders.from_splits('.', files[:4], [0, 1, 0, 1], files[4:6], [0, 1], bs=5, size=8, device='cpu')
    for bs,val_bs,n_valid,sizes in [(3, None, 2, [2]), (2, 4, 2, [2]), (2, 8, 7, [7]), (2, 3, 7, [3, 3, 1])]:
        dls = DaliDataLoaders.from_splits('.', files[:4], [0, 1, 0, 1], files[4:4+n_valid], list(range(n_valid)), bs=bs,
                                          val_bs=val_bs, size=8, device='cpu', vocab=list(range(8)))
        assert len(dls.valid) == len(sizes)
        for epoch in range(2):
            batches = [y.tolist() for _,y in dls.valid]
            assert [len(b) for b in batches] == sizes and flat(batches) == list(range(n_valid)), epoch  # each item once, in order
    assert [len(b[0]) for b in dls.test_dl(files[:1])] == [1], "test_dl (and predict) take any number of items"


def test_labels_files_mismatch(files):
    with pytest.raises(ValueError, match='3 files but 2 labels'): ImageItems(files[:3], [0, 1], ['a', 'b'])
    with pytest.raises(ValueError, match='3 files but 2 labels'):
        DaliDataLoaders.from_lists('.', files[:3], ['a', 'b'], device='cpu')
    with pytest.raises(ValueError, match='4 training files but 3 labels'):
        DaliDataLoaders.from_splits('.', files[:4], ['a', 'b', 'a'], files[4:6], ['a', 'b'], device='cpu')
    with pytest.raises(ValueError, match='2 validation files but 1 labels'):
        DaliDataLoaders.from_splits('.', files[:4], ['a', 'b', 'a', 'b'], files[4:6], ['a'], device='cpu')


def _jpeg(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((10, 10, 3), 100, dtype=np.uint8)).save(path)


def test_valid_class_unseen_in_train_is_named(tmp_path):
    for split,cls,n in [('train', 'cat', 3), ('train', 'dog', 3), ('valid', 'cat', 1), ('valid', 'axolotl', 1)]:
        for i in range(n): _jpeg(tmp_path/split/cls/f'{i}.jpg')
    with pytest.raises(ValueError, match=r"validation set has labels not seen in the training set: \['axolotl'\]"):
        DaliDataLoaders.from_folder(tmp_path, bs=2, size=8, device='cpu')


def test_empty_and_missing_folders(tmp_path):
    with pytest.raises(FileNotFoundError, match='does not exist'):
        DaliDataLoaders.from_folder(tmp_path/'nope', device='cpu')
    (tmp_path/'empty').mkdir()
    with pytest.raises(ValueError, match='no images in'): DaliDataLoaders.from_folder(tmp_path/'empty', device='cpu')
    with pytest.raises(ValueError, match='no images in'):
        DaliDataLoaders.from_folder(tmp_path/'empty', valid_pct=0.2, device='cpu')
    for i in range(3): _jpeg(tmp_path/'only_train'/'train'/'cat'/f'{i}.jpg')
    (tmp_path/'only_train'/'valid').mkdir()
    with pytest.raises(ValueError, match=r"no images in .*valid"):
        DaliDataLoaders.from_folder(tmp_path/'only_train', device='cpu')
    with pytest.raises(ValueError, match='no images in'): DaliDataLoaders.from_lists('.', [], [], device='cpu')


def test_one_batch_of_an_empty_epoch_says_why(files):
    dl = index_loader(files[:3], 4, train=True)
    assert len(dl) == 0 and list(dl) == []
    with pytest.raises(ValueError, match='yields no batch: 3 items with bs=4 and drop_last=True'): dl.one_batch()


def test_numpy_labels(files):
    items = ImageItems(files[:5], np.arange(5), [str(i) for i in range(5)])
    assert flat(epoch_items(DaliDataLoader(items, bs=2, size=8, device='cpu'))) == list(range(5))


def test_drain_limit_reaches_the_valid_loader(files):
    "`from_splits` documents **kwargs as `DaliDataLoader` options: drain_limit is one, but only train gets it"
    dls = DaliDataLoaders.from_splits('.', files[:8], [0, 1]*4, files[8:10], [0, 1], bs=2, size=8, device='cpu',
                                      drain_limit=0)
    assert dls.train.drain_limit == 0
    assert dls.valid.drain_limit == 0


# ---------------------------------------------------------------- seeds and shuffling

@pytest.fixture(scope='module')
def fmnist_files():
    files,labels = fmnist_subset(4)
    return files,[sorted(set(labels)).index(l) for l in labels],sorted(set(labels))


def _fm_loader(fmnist_files, seed, **kw):
    files,labels,vocab = fmnist_files
    return DaliDataLoader(ImageItems(files, labels, vocab), bs=8, size=16, train=True, device='cpu', seed=seed,
                          p_rotate=0.5, p_warp=0.3, max_lighting=0.2, **kw)


def _epochs(dl, n=2): return [b for _ in range(n) for b in dl]


def test_same_seed_same_batches_other_seed_other_batches(fmnist_files):
    a,b,c = [_epochs(_fm_loader(fmnist_files, seed)) for seed in (7, 7, 8)]
    assert len(a) == len(b) == len(c) == 2*5
    for (xa,ya),(xb,yb) in zip(a, b):
        assert torch.equal(ya, yb) and torch.equal(xa, xb), "same seed, same batches (CPU backend)"
    assert not all(torch.equal(ya, yc) for (_,ya),(_,yc) in zip(a, c)), "another seed, another order"
    assert not any(torch.equal(xa, xc) for (xa,_),(xc,_) in zip(a, c)), "another seed, other augmentations"


def test_same_seed_same_augmentation_in_order(fmnist_files):
    "With the order fixed, the seed alone decides the augmentation"
    a,b,c = [_epochs(_fm_loader(fmnist_files, seed, shuffle=False), 1) for seed in (3, 3, 4)]
    for (xa,ya),(xb,yb),(xc,yc) in zip(a, b, c):
        assert torch.equal(ya, yb) and torch.equal(ya, yc)
        assert torch.equal(xa, xb)
        assert not torch.equal(xa, xc)


def test_shuffle_differs_across_epochs(files):
    dl = index_loader(files[:30], 30, train=True, seed=0)
    orders = [flat(epoch_items(dl)) for _ in range(4)]
    for o in orders: assert sorted(o) == list(range(30))
    assert len({tuple(o) for o in orders}) == 4, "every epoch a new order"
    assert orders[0] != list(range(30)), "the first epoch is shuffled too"
    fresh = index_loader(files[:30], 30, train=True, seed=0)
    assert flat(epoch_items(fresh)) == orders[0], "seeded: a fresh loader replays the first epoch"


def test_rebuilt_loader_does_not_replay_first_epoch(files):
    dl = index_loader(files[:30], 5, train=True, seed=0, drain_limit=0)
    first_epoch = flat(epoch_items(dl))
    _break_after(1)(dl)
    after = flat(epoch_items(dl))
    assert sorted(after) == sorted(first_epoch)
    assert after != first_epoch


def test_shuffle_honoured_by_a_valid_style_loader(files):
    "fastai's `Learner.show_results` asks for `dls.valid.new(shuffle=True)`: a random batch, not always the first"
    dl = index_loader(files[:30], 30, shuffle=True, seed=0)
    assert dl.shuffle and not dl.train
    orders = [flat(epoch_items(dl)) for _ in range(3)]
    for o in orders: assert sorted(o) == list(range(30))
    assert len({tuple(o) for o in orders}) > 1, f"shuffle=True, but every epoch is {orders[0]}"


def test_valid_order_is_fixed(files):
    dl = index_loader(files[:10], 3, seed=0)
    assert [flat(epoch_items(dl)) for _ in range(3)] == [list(range(10))]*3


def test_empty_class_folder_is_an_error(tmp_path):
    "An empty class folder would silently not be a class: the error names it"
    for split,n in (('train', 4), ('valid', 2)):
        for cls in ('cat', 'dog'):
            (tmp_path/split/cls).mkdir(parents=True)
            for i in range(n): Image.new('RGB', (8, 8), (40*i, 90, 10)).save(tmp_path/split/cls/f'{i}.png')
    (tmp_path/'valid'/'bird').mkdir()
    with pytest.raises(ValueError, match=r"class folder\(s\) with no images: \['valid/bird'\]"):
        DaliDataLoaders.from_folder(tmp_path, bs=2, size=8, device='cpu')
    (tmp_path/'train'/'bird').mkdir()
    with pytest.raises(ValueError, match=r"\['train/bird'\]"):
        DaliDataLoaders.from_folder(tmp_path, valid_pct=0.25, bs=2, size=8, device='cpu')
    (tmp_path/'train'/'bird').rmdir(); (tmp_path/'valid'/'bird').rmdir()
    assert DaliDataLoaders.from_folder(tmp_path, bs=2, size=8, device='cpu').vocab == ['cat', 'dog']


# ---------------------------------------------------------------- prepare: the first batches made ahead

def _same_epochs(a, b):
    for (x1,y1),(x2,y2) in zip(a, b, strict=True):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)


def test_prepared_loader_reads_its_prepared_pipeline_with_the_same_batches(files):
    "`prepare` starts DALI on the first epoch now: that epoch reads the same pipeline (no second build) and the same batches"
    dl,twin = [index_loader(files[:21], 4, train=True, seed=7) for _ in range(2)]
    dl.prepare()
    it = dl._source.it
    assert it is not None and it._ever_scheduled, "prepare builds the pipeline and schedules its first runs"
    _same_epochs(dl, twin)
    assert dl._source.it is it and dl._source.builds == 1
    _same_epochs(dl, twin)  # the next epoch too, which DALI started as the first ended


def test_normalize_added_after_prepare_prepares_the_rebuilt_pipeline(files):
    "fastai's `vision_learner` adds a pretrained model's `Normalize` after the loaders are made: the rebuild is prepared, with the unread build's seeds"
    from fastai.data.transforms import Normalize
    norm = Normalize.from_stats((0.4, 0.5, 0.6), (0.2, 0.25, 0.3))
    dl,twin = [index_loader(files[:21], 4, train=True, seed=7) for _ in range(2)]
    dl.prepare(); prepared = dl._source.it
    dl.add_tfms([norm]); twin.add_tfms([norm])
    assert dl._source.it is not None and dl._source.it is not prepared and dl._source.it._ever_scheduled
    _same_epochs(dl, twin)


# ---------------------------------------------------------------- keep_batches: validation passes served from memory

def _kept_loader(files, **kwargs)->DaliDataLoader:
    "A validation loader that keeps its passes, fed as `DaliDataLoaders` feeds its validation loader"
    return index_loader(files, 4, keep_batches=True, **kwargs).fed_by([])


def _no_dali(epoch): raise AssertionError("this pass read DALI: it should have been served from the kept batches")


def _copies(dl)->list: return [tuple(t.clone() for t in b) for b in dl]


def _same(a:list, b:list)->bool: return len(a) == len(b) and all(torch.equal(s, t) for x,y in zip(a, b) for s,t in zip(x, y))


def test_kept_pass_serves_the_next_passes_without_dali(files):
    "A whole validation pass is kept: the next passes over the same items are its batches (labels and pixels), not DALI's reads"
    dl = _kept_loader(files[:21])
    first = _copies(dl)
    assert flat([y.tolist() for _,y in first]) == list(range(21)) and decode_index(first[0][0]) == [0, 1, 2, 3]
    dl._read = _no_dali
    assert _same(_copies(dl), first) and _same(_copies(dl), first)
    assert dl._epoch_no == 3
    assert _same(_copies(dl.new()), first), "a copy made alike (fastai's get_preds) reads the same kept pass"


def test_a_kept_pass_is_handed_out_as_copies(files):
    "What a model or callback does to a served batch in place does not reach the next pass"
    dl,ref = _kept_loader(files[:9]),_copies(index_loader(files[:9], 4).fed_by([]))
    for _ in range(3):
        for x,y in dl: x.zero_(); y.zero_()  # the first pass's batches were kept as copies; the next ones are served copies
    assert _same(_copies(dl), ref)


def test_only_whole_validation_passes_are_kept(files):
    "An abandoned pass, a training loader's passes and a loader not asked to keep them are read through DALI each time"
    dl = _kept_loader(files[:21])
    it = iter(dl); next(it); it.close()
    assert dl._source.kept is None
    for shuffle in (True, False):  # a training loader in order is fed too, and draws its augmentation anew each pass
        train = index_loader(files[:21], 4, train=True, shuffle=shuffle, keep_batches=True, seed=1).fed_by([])
        list(train); assert train._source.kept is None
    plain = index_loader(files[:21], 4).fed_by([])  # the default on the CPU: read each pass (a GPU keeps: below)
    list(plain); assert plain._source.kept is None


def test_other_items_through_the_same_pipeline_are_not_served_the_kept_pass(files):
    "A `test_dl` reads other files through the validation pipeline: its own batches, then validation reads its own again"
    dls = DaliDataLoaders.from_items('.', index_items(files[:21]), index_items(files[21:40]), bs=4, size=8, device='cpu',
                                     check_files=False, val_keep_batches=True)
    valid = _copies(dls.valid)
    assert dls.valid._source.kept is not None
    test = dls.test_dl(files[40:46])
    assert decode_index(torch.cat([b[0] for b in test])) == list(range(40, 46))
    assert _same(_copies(dls.valid), valid)


def _index_dls(files, device='cpu', **kwargs):
    return DaliDataLoaders.from_items('.', index_items(files[:21]), index_items(files[21:40]), bs=4, size=8, device=device,
                                      check_files=False, **{'val_keep_batches': True, **kwargs})


def test_the_kept_pass_is_of_these_items_as_this_loader_makes_them(files):
    "A `test_dl` over the validation files (unlabelled, or labelled anew) and a loader whose settings changed read their own"
    dls = _index_dls(files)
    valid = _copies(dls.valid)
    assert [len(b) for b in dls.test_dl(files[21:40])] == [1]*5, "unlabelled: images only, not validation's labels"
    other = dls.valid.new(items=index_items(files[40:46])).fed_by(dls._fed_pipelines)  # keeps too, same pipeline
    assert other._source is dls.valid._source and decode_index(torch.cat([x for x,_ in other])) == list(range(40, 46))
    dls.valid.bs = 8  # another batch size: other batches
    assert [len(b[0]) for b in dls.valid] == [8, 8, 3]
    dls.valid.bs = 4
    assert _same(_copies(dls.valid), valid)


def test_showing_a_batch_or_predicting_leaves_the_kept_pass(files):
    "`one_batch` (`show_batch`) and `test_dl` (`predict`) read through the validation pipeline without keeping, so its pass stays kept"
    dls = _index_dls(files)
    valid = _copies(dls.valid)
    kept = dls.valid._source.kept
    dls.valid.one_batch(); list(dls.test_dl(files[40:43]))
    assert dls.valid._source.kept is kept
    dls.valid._read = _no_dali
    assert _same(_copies(dls.valid), valid)


def test_a_normalize_added_later_keeps_validation_fed_and_kept(files):
    "`vision_learner` adds a pretrained model's `Normalize` to made loaders: validation still reads through the pool, and keeps"
    from fastai.data.transforms import Normalize
    dls = _index_dls(files)
    dls.add_tfms([Normalize.from_stats((0.4, 0.5, 0.6), (0.2, 0.25, 0.3))], 'after_batch')
    assert dls.valid._fed
    valid = _copies(dls.valid)
    assert dls.valid._source.kept is not None and dls.test_dl(files[40:43])._source is dls.valid._source
    dls.valid._read = _no_dali
    assert _same(_copies(dls.valid), valid)


def test_validation_moved_to_another_device_stays_fed(files, monkeypatch):
    "`dls.to(device)` gives validation the pool's pipeline for the new device, shared with `test_dl` there: it keeps again, not a reader of its own"
    dls = _index_dls(files)
    old = dls.valid._source
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)  # nothing is built before the next `iter()`: no GPU needed
    dls.to(torch.device('cuda', 0))
    assert dls.valid._fed and dls.valid._source is not old and dls.valid._keeps()
    assert dls.test_dl(files[40:43])._source is dls.valid._source
    dls.to(torch.device('cpu'))
    assert dls.valid._fed and dls.valid._source is old, "the pool's pipeline for the CPU again"


def test_a_pass_read_ahead_is_kept_and_served(files):
    "`read_ahead` (on a thread, while the learner is built) keeps validation's first pass: the loader's first pass reads no DALI, and is what DALI reads"
    dls = _index_dls(files)
    dls.valid.read_ahead()
    dls.valid._read = _no_dali  # the thread reads through a loader of its own
    valid = _copies(dls.valid)
    assert _same(valid, _copies(_index_dls(files, val_keep_batches=False).valid))
    assert dls.test_dl(files[40:43])._source is dls.valid._source, "the same pipeline as predict's"


def test_a_normalize_added_while_reading_ahead_is_read_ahead_anew(files):
    "A setting changed while the pass is read ahead (`vision_learner`'s pretrained `Normalize`): the pass for the new settings is read ahead and kept, normalized"
    from fastai.data.transforms import Normalize
    norm = lambda: Normalize.from_stats((0.4, 0.5, 0.6), (0.2, 0.25, 0.3))
    dls = _index_dls(files)
    dls.valid.read_ahead()
    dls.add_tfms([norm()], 'after_batch')
    dls.valid._read = _no_dali  # the loader's first pass is the one read ahead for the new settings
    fresh = _index_dls(files, val_keep_batches=False)
    fresh.add_tfms([norm()], 'after_batch')
    assert _same(_copies(dls.valid), _copies(fresh.valid)) and dls.valid._source.kept is not None


def test_a_bad_file_met_reading_ahead_is_said_at_the_loaders_pass(files, tmp_path):
    "The thread reading ahead says nothing of a file DALI cannot decode: the loader's own pass names it, as without reading ahead"
    from test_files import middle_garbage
    valid = [tmp_path/f.name for f in files[21:29]]
    for f,g in zip(files[21:29], valid): g.write_bytes(f.read_bytes())
    valid[5] = middle_garbage(valid[5].with_suffix('.jpg'))  # a JPEG: its stem still gives its label
    dls = DaliDataLoaders.from_items('.', index_items(files[:21]), index_items(valid), bs=4, size=8, device='cpu',
                                     check_files=False, val_keep_batches=True)
    dls.valid.read_ahead()
    with pytest.raises(ValueError, match=valid[5].name): list(dls.valid)


def test_a_pass_over_the_budget_is_not_kept_and_says_so_once(files, monkeypatch):
    "A pass holding more than `KEEP_SHARE` of the device's memory is read through DALI each time, with one warning"
    import dali_fastai.loader as loader_module
    monkeypatch.setattr(loader_module, 'KEEP_SHARE', 1e-9)
    dl = _kept_loader(files[:9])
    with pytest.warns(UserWarning, match='not kept'): first = _copies(dl)
    assert dl._source.kept is None
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        assert _same(_copies(dl), first)


@needs_gpu("a validation loader on a GPU keeps its pass unless told not to")
def test_on_a_gpu_validation_keeps_its_pass_by_default(files):
    "`keep_batches=None` (the default) keeps on a GPU: the next passes read no DALI; `val_keep_batches=False` reads each pass"
    dls = _index_dls(files, 'cuda', val_keep_batches=None)  # the default
    valid = _copies(dls.valid)
    assert dls.valid._source.kept is not None and valid[0][0].device.type == 'cuda'
    dls.valid._read = _no_dali
    assert _same(_copies(dls.valid), valid)
    read = _index_dls(files, 'cuda', val_keep_batches=False)
    assert _same(_copies(read.valid), valid) and read.valid._source.kept is None, "the same batches, read through DALI"


@needs_gpu("loaders made on a GPU read validation's first pass ahead")
def test_on_a_gpu_the_loaders_read_validation_ahead(files):
    "`from_items` on a GPU reads validation's first pass on a thread (`read_ahead`): the first pass reads no DALI, and is what DALI reads"
    dls = _index_dls(files, 'cuda', val_keep_batches=None)  # the default
    dls.valid._read = _no_dali
    valid = _copies(dls.valid)
    assert valid[0][0].device.type == 'cuda' and _same(valid, _copies(_index_dls(files, 'cuda', val_keep_batches=False).valid))


@needs_gpu("loaders made on the CPU and moved to a GPU")
def test_validation_moved_to_a_gpu_keeps_there(files):
    "`dls.to('cuda')`: validation reads through the pool's pipeline on the GPU, keeps its pass there, and serves the next from it"
    dls = _index_dls(files, 'cpu', val_keep_batches=None)  # the default: keeps on a GPU only
    on_cpu = _copies(dls.valid)
    dls.to('cuda')
    valid = _copies(dls.valid)
    assert dls.valid._source.kept is not None and valid[0][0].device.type == 'cuda'
    dls.valid._read = _no_dali
    assert _same(_copies(dls.valid), valid) and [torch.equal(x[1].cpu(), y[1]) for x,y in zip(valid, on_cpu, strict=True)] == [True]*len(on_cpu)


@needs_gpu("a pass over the budget on a GPU, kept by default")
def test_a_default_pass_over_the_budget_is_read_quietly(files, monkeypatch):
    "Where keeping is the default, not asked for, a pass over `KEEP_SHARE` is read through DALI with no warning"
    import dali_fastai.loader as loader_module, warnings
    monkeypatch.setattr(loader_module, 'KEEP_SHARE', 1e-9)
    dls = _index_dls(files, 'cuda', val_keep_batches=None)  # the default
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        list(dls.valid); list(dls.valid)
    assert dls.valid._source.kept is None and not [x for x in w if 'not kept' in str(x.message)]


def test_a_kept_pass_is_not_pickled(files):
    "`export` pickles the loaders: the kept batches stay out"
    dl = _kept_loader(files[:9])
    list(dl)
    assert dl._source.kept is not None and pickle.loads(pickle.dumps(dl))._source.kept is None
