"""WebDataset and TFRecord shards: a folder written as shards reads back as the same items, labels and pixels; every record once per
epoch over odd shard counts and batch sizes, on 1, 2 and 3 ranks; bad shards are named; resume; a Learner trains; a DataBlock's
targets (single- and multi-label, regression) come back as fastai encodes them."""
import os, sys
import numpy as np
import pytest
import torch

from dali_fastai.data import DaliDataLoaders
from dali_fastai.loader import DaliDataLoader
from dali_fastai.shards import write_shards, folder_shards, check_shards, ShardItems
from helpers import make_index_images, index_items, epoch_items, flat, decode_index, MAX_INDEX, assert_resume_replays, tiny_model

DEVICE = os.environ.get('DALI_FASTAI_TEST_DEVICE', 'cpu')  # `make gpu-test` runs these on the GPU backend too
N_TRAIN, N_VALID = 29, 11
VOCAB = [str(i) for i in range(MAX_INDEX)]


FROM = {'webdataset': DaliDataLoaders.from_webdataset, 'tfrecord': DaliDataLoaders.from_tfrecord}
SUFFIX = {'webdataset': 'tar', 'tfrecord': 'tfrecord'}


@pytest.fixture(scope='module', params=list(FROM))
def shards(tmp_path_factory, request):
    "Index images 0..39 (colour = index = label): 29 training records in shards of 5 (the last has 4), 11 validation in shards of 4"
    fmt = request.param
    root = tmp_path_factory.mktemp(fmt)
    files = make_index_images(root/'images', N_TRAIN + N_VALID)
    write_shards([(f, i) for i,f in enumerate(files[:N_TRAIN])], root, 'train', shard_size=5, progress=False, format=fmt)
    write_shards([(f, N_TRAIN + i) for i,f in enumerate(files[N_TRAIN:])], root, 'valid', shard_size=4, shuffle=False,
                 progress=False, format=fmt)
    (root/'vocab.txt').write_text('\n'.join(VOCAB) + '\n')
    return root,files,fmt



@pytest.mark.parametrize('fmt,module', [('webdataset', 'webdataset'), ('tfrecord', 'google_crc32c')])
def test_a_missing_shard_package_says_which_extra_installs_it(files, tmp_path, monkeypatch, fmt, module):
    "Without the `shards` extra, writing shards stops at once, naming what needed which module and the pip line, and writes no shard"
    monkeypatch.setitem(sys.modules, module, None)  # importing it raises ImportError, as when it is not installed
    with pytest.raises(ImportError, match=rf"needs? the module '{module}'.*pip install 'dali-fastai\[shards\]'"):
        write_shards([(f, i) for i,f in enumerate(files[:3])], tmp_path/'out', progress=False, format=fmt)
    assert not list((tmp_path/'out').glob(f'*.{SUFFIX[fmt]}'))

def loaders(shards, **kw):
    root,_,fmt = shards
    return FROM[fmt](root, **{'bs': 4, 'size': 8, 'device': DEVICE, 'seed': 0, **kw})


def test_every_record_once_with_its_label(shards):
    dls = loaders(shards, drop_last=False)
    assert len(dls.train.items) == N_TRAIN and len(dls.valid.items) == N_VALID and len(dls.train) == 8
    epochs = [flat(epoch_items(dls.train)) for _ in range(3)]  # labels agree with pixels in every batch
    for e in epochs: assert sorted(e) == list(range(N_TRAIN))
    assert len({tuple(e) for e in epochs}) == 3, "every epoch a new order"
    assert flat(epoch_items(dls.valid)) == list(range(N_TRAIN, N_TRAIN + N_VALID)), "validation: in order, once"


def test_same_pixels_as_the_folder_loader(shards):
    "Without augmentation, the validation records are the validation files' pixels, batch for batch"
    files = shards[1]
    ours = loaders(shards).valid
    folder = DaliDataLoader(index_items(files[N_TRAIN:]), bs=4, size=8, device=DEVICE)
    for (x0,y0),(x1,y1) in zip(ours, folder):
        assert torch.equal(x0, x1) and y0.tolist() == [int(v) for v in y1.tolist()]


@pytest.mark.parametrize('world', [2, 3])
def test_ranks_share_the_records(shards, world):
    "Validation on `world` ranks: the ranks' records together are every record once; training: each rank its own records"
    dls = loaders(shards, drop_last=False)
    seen = []
    for rank in range(world):
        dl = dls.valid.new(); dl.shard(rank, world)
        seen += flat(epoch_items(dl))
    assert sorted(seen) == list(range(N_TRAIN, N_TRAIN + N_VALID))
    train = []
    for rank in range(world):
        dl = dls.train.new(); dl.shard(rank, world, seed=0)
        ids = flat(epoch_items(dl))
        assert len(ids) == len(set(ids))
        train.append(set(ids))
    assert all(not (a & b) for i,a in enumerate(train) for b in train[i + 1:]), "no record on two ranks in one epoch"


def test_resume_replays_the_same_records(shards):
    assert_resume_replays(loaders(shards).train)


def test_bad_shards_are_named(shards, tmp_path):
    root,files,fmt = shards
    sfx = SUFFIX[fmt]
    good = sorted(root.glob(f'train-*.{sfx}'))[0]
    (tmp_path/f'train-000000.{sfx}').write_bytes(good.read_bytes()[:100 if fmt == 'tfrecord' else 2000])  # inside the first record
    (tmp_path/'vocab.txt').write_text('\n'.join(VOCAB))
    said = (r"cannot be read as a tar file .*truncated or damaged" if fmt == 'webdataset' else r"record 0 \(byte 0\) is cut short")
    with pytest.raises(ValueError, match=rf"shard .*train-000000.{sfx}: ?{said}" if fmt == 'tfrecord' else rf"shard .*train-000000.{sfx} {said}"):
        FROM[fmt](tmp_path, valid=[sorted(root.glob(f'valid-*.{sfx}'))[0]], device=DEVICE)
    with pytest.raises(ValueError, match=r"no shards"): FROM[fmt](tmp_path, train='none-*', device=DEVICE)
    with pytest.raises(FileNotFoundError, match=r"no vocab.txt"): FROM[fmt](tmp_path/'x', device=DEVICE)


def test_label_offset_and_fit(shards, tmp_path):
    "1-based labels read with label_offset=1; a Learner fits an epoch from shards"
    from fastai.learner import Learner
    import fastai.callback.progress  # noqa: F401 (Learner.no_bar)
    root,files,fmt = shards
    write_shards([(f, i + 1) for i,f in enumerate(files[:8])], tmp_path, 'train', shard_size=3, progress=False, format=fmt)
    write_shards([(f, i + 1) for i,f in enumerate(files[:8])], tmp_path, 'valid', shard_size=3, shuffle=False, progress=False, format=fmt)
    dls = FROM[fmt](tmp_path, vocab=VOCAB, label_offset=1, bs=4, size=8, device=DEVICE, seed=0, drop_last=False)
    assert sorted(flat(epoch_items(dls.train))) == list(range(8))
    learn = Learner(dls, tiny_model(len(VOCAB)), path=tmp_path)
    with learn.no_bar(), learn.no_logging(): learn.fit(1, 1e-3)
    preds,targs = learn.get_preds()
    assert preds.shape == (8, len(VOCAB)) and targs.tolist() == list(range(8))


def test_tta_builds_its_pipeline_once_and_validation_keeps_its_own(shards, tmp_path):
    """Records are read by DALI's readers, not fed: `learn.tta` reads the validation records through the training
    transforms on a pipeline built at its first call, kept beside validation's, which each plain pass reads again (each
    `tta` built two before: its own and validation's anew)"""
    from fastai.learner import Learner
    import fastai.callback.progress  # noqa: F401 (Learner.no_bar)
    dls = loaders(shards, drop_last=False)
    learn = Learner(dls, tiny_model(len(VOCAB)), path=tmp_path)
    builds = lambda: dls.valid._source.builds
    with learn.no_bar(), learn.no_logging():
        plain,_ = learn.get_preds(); seen = [builds()]
        learn.tta(n=2, beta=0.); seen.append(builds())  # beta=0: the augmented passes only
        learn.tta(n=2); again,targs = learn.get_preds(); seen.append(builds())
    assert seen == [1, 2, 2], seen
    assert torch.equal(again, plain) and targs.tolist() == list(range(N_TRAIN, N_TRAIN + N_VALID))  # validation's, from its start
    assert list(dls.valid._source.other) == [(0, 0, 1)]  # kept: the pipeline of the training transforms (split 0), one rank
    # (these one-colour images look alike through any crop or flip: the augmented passes' predictions cannot tell)


@pytest.mark.parametrize('fmt', list(FROM))
def test_folder_to_shards_round_trip(tmp_path, fmt):
    "An ImageNet-style folder written with `folder_shards` gives the loaders the folder gives: same vocab, same validation batches"
    from PIL import Image
    for split,n in (('train', 6), ('valid', 3)):
        for k,c in enumerate(('cat', 'dog')):
            (tmp_path/'src'/split/c).mkdir(parents=True)
            for i in range(n): Image.fromarray(np.full((10, 12, 3), (40*i, 100*k, 50), np.uint8)).save(tmp_path/'src'/split/c/f'{i}.png')
    folder_shards(tmp_path/'src', tmp_path/'out', shard_size=5, progress=False, format=fmt)
    assert check_shards(tmp_path/'out', progress=False) == 18
    a = DaliDataLoaders.from_folder(tmp_path/'src', bs=3, size=8, device=DEVICE, seed=0)
    b = FROM[fmt](tmp_path/'out', bs=3, size=8, device=DEVICE, seed=0)
    assert a.vocab == b.vocab == ['cat', 'dog'] and len(a.train.items) == len(b.train.items) == 12
    for (x0,y0),(x1,y1) in zip(a.valid, b.valid): assert torch.equal(x0, x1) and torch.equal(y0, y1)


def _index_of(f)->int: return int(f.stem)

@pytest.mark.parametrize('fmt', list(FROM))
@pytest.mark.parametrize('kind', ['multi', 'regression', 'single'])
def test_dblock_shards_targets_as_fastai_encodes_them(tmp_path, fmt, kind):
    "A DataBlock written with `dblock_shards`: every record's target is what fastai's own Datasets gives its image, of fastai's type"
    from fastai.data.block import DataBlock, CategoryBlock, MultiCategoryBlock, RegressionBlock
    from fastai.data.transforms import FuncSplitter
    from fastai.vision.data import ImageBlock
    from dali_fastai.shards import dblock_shards
    files = make_index_images(tmp_path/'images', 23)
    tags = lambda f: [t for t,on in (('odd', _index_of(f) % 2), ('big', _index_of(f) > 9), ('three', _index_of(f) % 3 == 0)) if on]
    y_block,get_y = {'multi': (MultiCategoryBlock, tags),
                     'regression': (RegressionBlock, lambda f: 0.5*_index_of(f) - 3.),
                     'single': (CategoryBlock, lambda f: 'abc'[_index_of(f) % 3])}[kind]
    dblock = DataBlock(blocks=(ImageBlock, y_block), get_y=get_y, splitter=FuncSplitter(lambda f: _index_of(f) >= 17))
    dblock_shards(dblock, files, tmp_path/'shards', shard_size=4, progress=False, format=fmt)
    dls = FROM[fmt](tmp_path/'shards', bs=3, size=8, device=DEVICE, seed=0, drop_last=False)
    dsets = dblock.datasets(files)  # fastai's own encoding of each item's target
    want = {_index_of(f): y for f,(_,y) in zip([*dsets.train.items, *dsets.valid.items], [*dsets.train, *dsets.valid])}
    seen = []
    for dl in (dls.train, dls.valid):
        for x,y in dl:
            assert type(y) is type(want[0]), f"{type(y).__name__} is not fastai's {type(want[0]).__name__}"
            for i,yi in zip(decode_index(x), y): assert torch.allclose(yi.float().cpu(), want[i].float()), (i, yi, want[i]); seen.append(i)
    assert sorted(seen) == list(range(23)), "every record once, train then valid"
    if kind != 'regression': assert list(dls.vocab) == list(dsets.vocab)
    assert dls.valid.decode_batch(dls.valid.one_batch())  # decodes as fastai's loaders do (show_batch)
    if kind == 'multi':  # a Learner picks fastai's multi-label loss from the targets, and trains
        from fastai.learner import Learner
        from fastai.losses import BCEWithLogitsLossFlat
        import fastai.callback.progress  # noqa: F401 (Learner.no_bar)
        learn = Learner(dls, tiny_model(len(dls.vocab)), path=tmp_path)
        assert isinstance(learn.loss_func, BCEWithLogitsLossFlat)
        with learn.no_bar(), learn.no_logging(): learn.fit(1, 1e-3)


def test_dblock_shards_refuses_masks_and_stale_targets(tmp_path):
    "Masks are not written to shards (DALI reads them from files of their own); targets of other shards are named"
    from fastai.data.block import DataBlock, CategoryBlock
    from fastai.data.transforms import FuncSplitter
    from fastai.vision.data import ImageBlock, MaskBlock
    from dali_fastai.shards import dblock_shards
    files = make_index_images(tmp_path/'images', 8)
    split = FuncSplitter(lambda f: _index_of(f) > 5)
    masks = DataBlock(blocks=(ImageBlock, MaskBlock(codes=['a', 'b'])), get_y=lambda f: f, splitter=split)
    with pytest.raises(ValueError, match=r"mask targets \(MaskBlock\).*not written to shards yet.*from_dblock"):
        dblock_shards(masks, files, tmp_path/'m', progress=False)
    cats = DataBlock(blocks=(ImageBlock, CategoryBlock), get_y=lambda f: str(_index_of(f) % 2), splitter=split)
    dblock_shards(cats, files, tmp_path/'a', shard_size=3, progress=False)
    dblock_shards(cats, files[:7], tmp_path/'b', shard_size=3, progress=False)
    (tmp_path/'b'/'targets.pkl').replace(tmp_path/'a'/'targets.pkl')  # 6 training targets for 6 records, 1 valid for 2
    with pytest.raises(ValueError, match=r"2 records in .* but \[1\] rows of targets"):
        DaliDataLoaders.from_webdataset(tmp_path/'a', bs=2, size=8, device=DEVICE)


def test_tfrecord_feature_names_are_read(tmp_path):
    "Records whose features are named otherwise than ImageNet's: `image_key` and `label_key` name them, every label read"
    from dali_fastai.shards import tf_example, tf_record
    files = make_index_images(tmp_path/'images', 12)
    for split,idx in (('train', range(8)), ('valid', range(8, 12))):
        (tmp_path/f'{split}-000000.tfrecord').write_bytes(b''.join(
            tf_record(tf_example(files[i].read_bytes(), i, image_key='jpeg', label_key='class/id')) for i in idx))
    (tmp_path/'vocab.txt').write_text('\n'.join(VOCAB) + '\n')
    dls = DaliDataLoaders.from_tfrecord(tmp_path, image_key='jpeg', label_key='class/id', bs=4, size=8, device=DEVICE,
                                        seed=0, drop_last=False)
    assert sorted(flat(epoch_items(dls.train))) == list(range(8))  # labels agree with the pixels (not all 0, not -1)
    assert flat(epoch_items(dls.valid)) == list(range(8, 12))


def test_webdataset_keys_end_at_the_first_dot(tmp_path):
    "A sample's files share the name up to the first dot of the file name (`k.seg.png` belongs to `k`), as DALI reads them"
    import io, tarfile
    files = make_index_images(tmp_path/'images', 10)
    for split,idx in (('train', range(6)), ('valid', range(6, 10))):
        with tarfile.open(tmp_path/f'{split}-000000.tar', 'w') as tar:
            for i in idx:
                for name,data in ((f'set.v2/{i:03d}.png', files[i].read_bytes()), (f'set.v2/{i:03d}.cls', str(i).encode()),
                                  (f'set.v2/{i:03d}.seg.png', files[(i + 1) % 10].read_bytes())):  # another image: not this sample's
                    info = tarfile.TarInfo(name); info.size = len(data); tar.addfile(info, io.BytesIO(data))
    (tmp_path/'vocab.txt').write_text('\n'.join(VOCAB) + '\n')
    dls = DaliDataLoaders.from_webdataset(tmp_path, bs=2, size=8, device=DEVICE, seed=0, drop_last=False)
    assert (len(dls.train.items), len(dls.valid.items)) == (6, 4)
    assert sorted(flat(epoch_items(dls.train))) == list(range(6))  # each sample's own .png, with its own .cls
    assert flat(epoch_items(dls.valid)) == list(range(6, 10))
