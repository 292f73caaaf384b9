"""Wrong arguments fail where they enter, in the words of the argument (`check_arg`), before any file is read; and the
checks keep no reference to the loader (a loader goes by reference counting, without the garbage collector)."""
import gc, weakref
import pandas as pd
import pytest
from fastai.data.block import DataBlock, CategoryBlock
from fastai.vision.data import ImageBlock

from dali_fastai.loader import DaliDataLoader
from dali_fastai.data import DaliDataLoaders
from helpers import index_items, index_loader


@pytest.mark.parametrize('kw,msg', [
    (dict(size='abc'), "size must be an int or (height, width) of ints, each at least 1, got 'abc'"),
    (dict(size='64'), "size must be an int or (height, width) of ints, each at least 1, got '64'"),
    (dict(size=64.5), "size must be an int or (height, width) of ints, each at least 1, got 64.5"),
    (dict(size=(64, 'a')), "got (64, 'a')"),
    (dict(bs='8'), "bs must be an int of at least 1, got '8'"),
    (dict(bs=True), "bs must be an int of at least 1, got True"),
    (dict(train='yes'), "train must be True or False, got 'yes'"),
    (dict(seed=1.5), "seed must be an int or None, got 1.5"),
    (dict(device=0.5), "device must be 'cpu', 'gpu'"),
    (dict(prefetch=0), "prefetch must be an int of at least 1, got 0"),
    (dict(mean=0.5), "mean must be a tuple of numbers"),
    (dict(dtype='half'), "dtype must be 'float32' or 'float16', got 'half'"),
    (dict(crop_pct=1.5), "crop_pct must be a number in (0, 1], got 1.5"),
    (dict(p_hflip='0.5'), "p_hflip must be a probability from 0 to 1, got '0.5'"),
    (dict(warp_mode='fix'), "warp_mode must be 'fixed', 'random' or None, got 'fix'"),
])
def test_loader_arguments(files, kw, msg):
    with pytest.raises((TypeError, ValueError)) as e: DaliDataLoader(index_items(files[:4]), **{'bs': 2, 'device': 'cpu', **kw})
    assert msg in str(e.value)


def test_loader_items(files):
    with pytest.raises(TypeError, match=r"items must be ImageItems \(the files and their targets\)"): DaliDataLoader(files[:4])


@pytest.mark.parametrize('make,msg', [
    (lambda f: DaliDataLoaders.from_folder(f[0].parent, bs='8'), "bs must be an int of at least 1, got '8'"),
    (lambda f: DaliDataLoaders.from_folder(f[0].parent, size='abc'), "size must be an int or (height, width) of ints"),
    (lambda f: DaliDataLoaders.from_folder(f[0].parent, valid_pct='0.2'), "valid_pct must be a number between 0 and 1"),
    (lambda f: DaliDataLoaders.from_folder(f[0].parent, train=1), "train must be a subfolder name (a str), got 1"),
    (lambda f: DaliDataLoaders.from_folder(f[0].parent, val_bs='4'), "val_bs must be an int of at least 1, or None"),
    (lambda f: DaliDataLoaders.from_folder(f[0].parent, val_size='x'), "val_size must be an int or (height, width)"),
    (lambda f: DaliDataLoaders.from_lists('.', f[:8], [0, 1]*4, valid_pct=20), "valid_pct must be a number between 0 and 1 (the share held out for validation), got 20"),
    (lambda f: DaliDataLoaders.from_lists(3, f[:8], [0, 1]*4), "path must be a folder (a str or Path), got 3"),
    (lambda f: DaliDataLoaders.from_lists('.', 'images/', [0, 1]*4), "fnames must be a list of image files, got 'images/'"),
    (lambda f: DaliDataLoaders.from_name_func('.', f[:8], 'cat'), "label_func must be a function from an image file to its label"),
    (lambda f: DaliDataLoaders.from_name_re('.', f[:8], 3), "pat must be a regular expression (a str), got 3"),
    (lambda f: DaliDataLoaders.from_df([1, 2]), "df must be a pandas DataFrame"),
    (lambda f: DaliDataLoaders.from_df(pd.DataFrame({'a': [str(x) for x in f[:8]], 'b': [0, 1]*4}), label_delim=1),
     "label_delim must be a str, or None, got 1"),
    (lambda f: DaliDataLoaders.from_dblock('not a block', f[:8]), "dblock must be a fastai DataBlock"),
    (lambda f: DaliDataLoaders.from_dblock(DataBlock((ImageBlock, CategoryBlock)), f[:8], void_code=300),
     "void_code must be an int from 0 to 255, or None, got 300"),
    (lambda f: DaliDataLoaders.from_splits('.', f[:4], [0, 1]*2, f[4:6], [0, 1], seed='0'), "seed must be an int or None, got '0'"),
    (lambda f: DaliDataLoaders.from_items('.', f[:4], f[4:6]), "train must be ImageItems"),
    (lambda f: DaliDataLoaders.from_coco('.', train_json=1), "train_json must be a json file under path, got 1"),
    (lambda f: DaliDataLoaders.from_webdataset('.', label_offset='1'), "label_offset must be an int, got '1'"),
])
def test_constructor_arguments(files, make, msg):
    with pytest.raises((TypeError, ValueError)) as e: make(files)
    assert msg in str(e.value)


def test_loaders_go_without_the_garbage_collector(files):
    "Checking the arguments keeps no reference cycle: the loaders and their DALI pipelines go as soon as they are dropped"
    gc.disable()
    try:
        dl = index_loader(files[:8], 4)
        for _ in dl: pass
        ref = weakref.ref(dl); del dl
        assert ref() is None
        dls = DaliDataLoaders.from_splits('.', files[:8], [0, 1]*4, files[8:12], [0, 1]*2, bs=4, size=8, device='cpu')
        ref = weakref.ref(dls.train); del dls
        assert ref() is None
    finally: gc.enable()
