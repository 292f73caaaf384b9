"""Segmentation masks follow every geometric augmentation of their images: images whose pixels carry their class as a colour
(grey, red, green, blue rectangles) and masks that say the same go through `DaliDataLoaders.from_label_func` with each
fastai transform alone (p=1) and with `aug_transforms()`; at least 99% of the mask's non-void pixels (those away from a
class border) must agree with the class of their pixel's colour, on the CPU backend (and on the GPU backend with
`DALI_FASTAI_TEST_DEVICE=gpu`, as `make gpu-test` runs it). Then: fastai's items, codes and split; bad masks; training."""
import os
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from fastai.vision.all import (DataBlock, ImageBlock, MaskBlock, FuncSplitter, Resize, RandomResizedCrop, RandomCrop, CropPad,
                               FlipItem, DihedralItem, Flip, Dihedral, Rotate, Zoom, Warp, Brightness, aug_transforms,
                               SegmentationDataLoaders, TensorMask, Learner, load_learner, foreground_acc, DiceMulti)
from fastai.vision.learner import get_c
from fastai.callback.core import Callback
from PIL import Image

from dali_fastai.data import DaliDataLoaders
from helpers import assert_resume_replays

DEVICE = os.environ.get('DALI_FASTAI_TEST_DEVICE', 'cpu')
H, W = 96, 128
CODES = ['grey', 'red', 'green', 'blue']
COLOURS = [(128, 128, 128), (230, 20, 20), (20, 220, 20), (20, 20, 230)]
N = 8


def scene(i:int)->tuple:
    "Image `i` and its mask: grey, with three to five rectangles of pure colours"
    rng = np.random.default_rng(i)
    img,mask = np.full((H, W, 3), 128, np.uint8),np.zeros((H, W), np.uint8)
    for _ in range(3 + i % 3):
        c,w,h = rng.integers(1, 4),rng.integers(16, 48),rng.integers(16, 40)
        l,t = rng.integers(0, W - w),rng.integers(0, H - h)
        img[t:t + h, l:l + w],mask[t:t + h, l:l + w] = COLOURS[c],c
    return img,mask


@pytest.fixture(scope='module')
def scenes(tmp_path_factory):
    "Images (PNG) and their masks, half of them grayscale PNGs, half paletted (as CamVid's and VOC's are)"
    root = tmp_path_factory.mktemp('colours')
    (root/'images').mkdir(); (root/'labels').mkdir()
    for i in range(2*N):
        img,mask = scene(i)
        name = f"{'valid' if i >= N else 'train'}_{i:02d}"
        Image.fromarray(img).save(root/'images'/f'{name}.png')
        m = Image.fromarray(mask)
        if i % 2: m = Image.frombytes('P', (W, H), mask.tobytes()); m.putpalette([v for c in COLOURS for v in c] + [0]*(768 - 12))
        m.save(root/'labels'/f'{name}.png')
    return root


def label_func(root): return lambda o: root/'labels'/o.name


def seg_dblock(root, item_tfms, batch_tfms=None)->DataBlock:
    return DataBlock(blocks=(ImageBlock, MaskBlock(CODES)), get_items=lambda p: sorted((p/'images').glob('*.png')),
                     get_y=label_func(root), splitter=FuncSplitter(lambda o: o.name.startswith('valid')),
                     item_tfms=item_tfms, batch_tfms=batch_tfms)


def loaders(root, item_tfms, batch_tfms=None, **kw):
    return DaliDataLoaders.from_dblock(seg_dblock(root, item_tfms, batch_tfms), root, **{'bs': N, 'device': DEVICE, 'seed': 0, **kw})


def colour_class(x:torch.Tensor)->torch.Tensor:
    "The class of each pixel's colour in denormalized `[bs, 3, h, w]` images: grey (channels close), else the largest channel"
    spread = x.amax(1) - x.amin(1)
    return torch.where(spread < 0.25, 0, x.argmax(1) + 1)


def _agree(dl, x, y, void:int|None)->tuple:
    "(pixels that agree, pixels counted) of one batch: not void, not within 2 pixels of a class border"
    img = dl.decode((x, y))[0].cpu().as_subclass(torch.Tensor)
    assert isinstance(y, TensorMask) and y.dtype == torch.long and y.shape == (len(x), *x.shape[-2:])
    y = y.cpu().as_subclass(torch.Tensor)
    yf = y[:, None].float()
    lo,hi = -F.max_pool2d(-yf, 5, 1, 2)[:, 0],F.max_pool2d(yf, 5, 1, 2)[:, 0]
    keep = (lo == hi) & (y != (-1 if void is None else void))
    assert keep.sum() > (0.3 if void is None else 0.1)*y.numel()  # enough pixels away from borders (and from the void)
    return int(((colour_class(img) == y) & keep).sum()),int(keep.sum())


def agreement_of(dl, void:int|None=None, batches:int=100)->float:
    "Share of mask pixels whose image colour says the same class, over an epoch of `dl` (at most `batches` batches)"
    counts = [_agree(dl, x, y, void) for k,(x,y) in zip(range(batches), dl)]
    return sum(a for a,_ in counts)/sum(t for _,t in counts)


def agreement(dls, void:int|None=None, batches:int=2)->float:
    "`agreement_of` the first `batches` batches of the training and the validation loader"
    return min(agreement_of(dl, void, batches) for dl in (dls.train, dls.valid))


ALONE = {
    'Resize crop': ([Resize(64)], None),
    'Resize squish': ([Resize(64, method='squish')], None),
    'Resize pad zeros': ([Resize(64, method='pad', pad_mode='zeros')], None),
    'Resize pad reflection': ([Resize(64, method='pad')], None),
    'RandomResizedCrop': ([RandomResizedCrop(64, min_scale=0.3)], None),
    'RandomCrop': ([RandomCrop(80)], None),
    'CropPad': ([CropPad(112)], None),
    'FlipItem': ([Resize(64), FlipItem(p=1.)], None),
    'DihedralItem': ([Resize(64), DihedralItem(p=1.)], None),
    'Flip': ([Resize(64)], [Flip(p=1.)]),
    'Dihedral': ([Resize(64)], [Dihedral(p=1.)]),
    'Rotate': ([Resize(64)], [Rotate(max_deg=30, p=1.)]),
    'Zoom': ([Resize(64)], [Zoom(min_zoom=0.7, max_zoom=1.5, p=1.)]),
    'Warp': ([Resize(64)], [Warp(magnitude=0.3, p=1.)]),
    'Brightness': ([Resize(64)], [Brightness(max_lighting=0.4, p=1.)]),
    'aug_transforms': ([Resize(80)], aug_transforms(size=64, max_rotate=20, min_zoom=0.8, max_warp=0.3)),
}


@pytest.mark.parametrize('name', list(ALONE))
def test_masks_follow_each_transform(scenes, name):
    item,batch = ALONE[name]
    assert agreement(loaders(scenes, item, batch)) >= 0.99


def test_void_code_marks_padding_only(scenes):
    "With void_code, what the augmentation pads is void (and only that): zooming out pads, and the rest still agrees"
    dls = loaders(scenes, [Resize(64)], [Zoom(min_zoom=0.5, max_zoom=0.6, p=1., pad_mode='reflection')], void_code=255)
    _,y = dls.train.one_batch()
    void = (y == 255).float().mean().item()
    assert 0.3 < void < 0.9, void  # a zoom of 0.5-0.6 leaves 64-75% of the output outside the image
    assert agreement(dls, void=255) >= 0.99
    _,y = loaders(scenes, [Resize(64)], [Zoom(min_zoom=0.5, max_zoom=0.6, p=1.)]).train.one_batch()
    assert not (y == 255).any() and y.max() < len(CODES)  # reflection invents labels, all of them codes


def test_same_items_codes_and_split_as_fastai(scenes):
    files = sorted((scenes/'images').glob('*.png'))
    kw = dict(valid_pct=0.25, seed=7, codes=CODES, item_tfms=Resize(64), bs=4)
    ours = DaliDataLoaders.from_label_func(scenes, files, label_func(scenes), device=DEVICE, **kw)
    theirs = SegmentationDataLoaders.from_label_func(scenes, files, label_func(scenes), num_workers=0, **kw)
    assert [str(f) for f in ours.train.items.files] == [str(f) for f in theirs.train_ds.items]
    assert [str(f) for f in ours.valid.items.files] == [str(f) for f in theirs.valid_ds.items]
    assert ours.vocab == CODES and get_c(ours) == get_c(theirs) == len(CODES)  # what unet_learner's n_out is
    assert type(ours.loss_func) is type(theirs.loss_func) and ours.loss_func.axis == 1
    # no augmentation, in order: fastai's grayscale masks and ours are the same pixels (Resize, nearest, for both)
    (_,y0),(_,y1) = ours.valid.one_batch(),next(iter(theirs.valid))
    assert type(y0) is type(y1) and y0.shape == y1.shape
    gray = [i for i,f in enumerate(ours.valid.items.files[:4]) if int(f.stem[-2:]) % 2 == 0]
    paletted = [i for i in range(4) if i not in gray]
    assert gray and paletted
    assert (y0[gray].cpu() == y1[gray].cpu()).float().mean() > 0.995
    # paletted masks: fastai's PILMask opens them as luminance ('L'), so its values are not the codes; ours are the indices
    assert y1[paletted].max() >= len(CODES) and y0[paletted].max() < len(CODES)


def test_paletted_and_rgb_masks(scenes, tmp_path):
    "Paletted masks give their indices (not their colours); RGB-coded masks go through `mask_colours`"
    (tmp_path/'images').mkdir(); (tmp_path/'labels').mkdir()
    for f in sorted((scenes/'images').glob('*.png')):
        (tmp_path/'images'/f.name).write_bytes(f.read_bytes())
        Image.open(scenes/'labels'/f.name).convert('RGB').save(tmp_path/'labels'/f.name)
    table = {c: i for i,c in enumerate(COLOURS)}
    table[(0, 0, 0)] = 0  # the grayscale masks' codes 0-3 drawn as RGB: near-black colours
    table.update({(i, i, i): i for i in range(4)})
    rgb = loaders(tmp_path, [Resize(64)], mask_colours=table)
    ref = loaders(scenes, [Resize(64)])
    assert (rgb.valid.one_batch()[1].cpu() == ref.valid.one_batch()[1].cpu()).all()
    with pytest.raises(ValueError, match=r"16 bad mask\(s\): \S*train_00.png: an RGB mask: pass colours="):
        loaders(tmp_path, [Resize(64)])


def test_bad_masks_are_named(scenes, tmp_path):
    (tmp_path/'images').mkdir(); (tmp_path/'labels').mkdir()
    for i in range(4):
        img,mask = scene(i)
        name = f"{'valid' if i >= 2 else 'train'}_{i:02d}.png"
        Image.fromarray(img).save(tmp_path/'images'/name)
        if i == 1: Image.fromarray(mask[:50]).save(tmp_path/'labels'/name)
        elif i == 2: Image.fromarray(mask).save(tmp_path/'labels'/name.replace('.png', '.jpg'))
        elif i != 3: Image.fromarray(mask).save(tmp_path/'labels'/name)
    with pytest.raises(ValueError) as e: loaders(tmp_path, [Resize(64)])
    msg = str(e.value)
    assert '3 bad mask(s)' in msg and 'train_01.png: the mask is 128×50 but its image' in msg
    assert 'valid_02.png: file does not exist' in msg and 'valid_03.png: file does not exist' in msg
    # a mask value that is not a code: found when the loaders are made, before any pipeline, with the mask's name
    Image.fromarray(scene(1)[1]).save(tmp_path/'labels'/'train_01.png')
    Image.fromarray(scene(3)[1]).save(tmp_path/'labels'/'valid_03.png')
    Image.fromarray(scene(2)[1]).save(tmp_path/'labels'/'valid_02.png')
    bad = scene(0)[1]; bad[0, 0] = 9
    Image.fromarray(bad).save(tmp_path/'labels'/'train_00.png')
    with pytest.raises(ValueError, match=r"1 bad mask\(s\): \S*train_00.png: has value 9, but there are 4 codes \(0 to 3\)\. "
                                         r".*or pass void_code=9"):
        loaders(tmp_path, [Resize(64)], bs=2)
    assert loaders(tmp_path, [Resize(64)], bs=2, void_code=9).train.one_batch()[1].shape == (2, 64, 64)
    # a mask changed into a bad one after the loaders were made: DALI's decode still names it
    dls = loaders(tmp_path, [Resize(64)], bs=2, void_code=9)
    bad[0, 0] = 7; Image.fromarray(bad).save(tmp_path/'labels'/'train_00.png')
    with pytest.raises(ValueError, match=r"mask .*train_00.png has value 7, but there are 4 codes \(0 to 3\)"): dls.train.one_batch()
    # a JPEG mask is refused: its values are not codes
    (tmp_path/'labels'/'valid_02.jpg').replace(tmp_path/'labels'/'valid_02.png')
    with pytest.raises(ValueError, match=r"valid_02.png: a JPEG mask"): loaders(tmp_path, [Resize(64)])


def pixel_net(c:int):
    "A per-pixel classifier (1×1 convolutions): the colours say the classes, so it learns them in a few steps"
    return torch.nn.Sequential(torch.nn.Conv2d(3, 32, 1), torch.nn.ReLU(), torch.nn.Conv2d(32, c, 1))


def test_learner_fits_predicts_and_exports(scenes, tmp_path):
    dls = loaders(scenes, [Resize(64)], aug_transforms(size=64), bs=4)
    learn = Learner(dls, pixel_net(dls.c), metrics=[DiceMulti(), foreground_acc], path=tmp_path)
    learn.fit(30, 3e-2)
    assert learn.recorder.values[-1][-1] > 0.8  # foreground accuracy: colours are easy to learn
    preds,targs = learn.get_preds()
    assert preds.shape == (N, len(CODES), 64, 64) and targs.shape == (N, 64, 64)
    learn.export('seg.pkl')
    loaded = load_learner(tmp_path/'seg.pkl', cpu=DEVICE == 'cpu')
    mask,_,probs = loaded.predict(scenes/'images'/'valid_08.png')
    assert isinstance(mask, TensorMask) and mask.shape == (64, 64) and probs.shape == (len(CODES), 64, 64)
    learn.show_results(max_n=2)
    dls.show_batch(max_n=2)


def test_unet_learner(scenes):
    "fastai's `unet_learner` builds on DALI's loaders (its size and classes come from them) and fits a batch"
    from fastai.vision.all import unet_learner, resnet18
    dls = loaders(scenes, [Resize(64)], bs=4)
    learn = unet_learner(dls, resnet18, pretrained=False, n_out=None)
    learn.fit(1, 1e-3)
    assert learn.model(dls.one_batch()[0]).shape == (4, len(CODES), 64, 64)


def test_resume_and_epochs_keep_masks_with_their_images(scenes):
    "Masks stay with their images over shuffled epochs, and a loader restored from `state_dict` mid-epoch replays both"
    dl = loaders(scenes, [Resize(64)], aug_transforms(size=64), bs=2).train
    for _ in range(3): assert agreement_of(dl) >= 0.99  # three shuffled epochs: the side reader reshuffles as the images'
    assert_resume_replays(dl)


def test_sharded_loaders_keep_masks_with_their_images(scenes):
    "Each DDP rank's shard (both readers sharded alike) keeps every mask with its image"
    dls = loaders(scenes, [Resize(64)], aug_transforms(size=64), bs=2)
    for rank in range(2):
        dl = dls.train.new(); dl.shard(rank, 2)
        assert agreement_of(dl) >= 0.99


def test_small_validation_set_trains_and_validates_every_image(tmp_path):
    "30 images, valid_pct=0.2, bs=8: fastai validates its 6 images in one partial batch; so do we, through `fit`"
    (tmp_path/'images').mkdir(); (tmp_path/'labels').mkdir()
    for i in range(30):
        img,mask = scene(i)
        Image.fromarray(img).save(tmp_path/'images'/f'{i:02d}.png'); Image.fromarray(mask).save(tmp_path/'labels'/f'{i:02d}.png')
    files = sorted((tmp_path/'images').glob('*.png'))
    kw = dict(valid_pct=0.2, seed=0, codes=CODES, item_tfms=Resize(32), bs=8)
    ours = DaliDataLoaders.from_label_func(tmp_path, files, label_func(tmp_path), device=DEVICE, **kw)
    theirs = SegmentationDataLoaders.from_label_func(tmp_path, files, label_func(tmp_path), num_workers=0, **kw)
    assert (len(ours.train), len(ours.valid)) == (len(theirs.train), len(theirs.valid)) == (3, 1)
    assert [len(y) for _,y in ours.valid] == [len(y) for _,y in theirs.valid] == [6]
    ys = []
    class KeepValidTargets(Callback):
        def after_batch(self):
            if not self.training: ys.append(self.yb[0].cpu())
    learn = Learner(ours, pixel_net(ours.c), cbs=KeepValidTargets(), path=tmp_path)
    learn.fit(1)
    assert [len(y) for y in ys] == [6] and np.isfinite(learn.recorder.values[0][1])  # validated: one batch, a loss
    # every validation image once, in fastai's order: the masks are fastai's (grayscale masks, Resize: nearest for both)
    assert [str(f) for f in ours.valid.items.files] == [str(f) for f in theirs.valid_ds.items]
    assert (ys[0] == torch.cat([y for _,y in theirs.valid]).cpu()).float().mean() > 0.99


def test_mask_values_are_read_once_with_progress_on_large_sets(tmp_path, monkeypatch, capsys):
    "Over 2000 masks show a progress bar on a terminal; each mask is decoded once, then its values come from the cache"
    import io, sys
    import dali_fastai.masks as masks
    monkeypatch.setattr(masks, 'cache_dir', lambda: tmp_path/'cache')
    Image.fromarray(np.zeros((2, 3, 3), np.uint8)).save(tmp_path/'img.png')
    files = [tmp_path/f'{i}.png' for i in range(2001)]
    for i,f in enumerate(files): Image.fromarray(np.full((2, 3), i % 3, np.uint8)).save(f)
    class Terminal(io.StringIO):
        def isatty(self): return True
    monkeypatch.setattr(sys, 'stdout', Terminal())
    ready = masks.prepare_masks(files, [tmp_path/'img.png']*len(files))  # a progress bar over a list of futures
    assert masks.mask_values(ready) == [[i % 3] for i in range(len(files))]
    assert sys.stdout.getvalue().count('2001/2001') == 1 and sys.stdout.getvalue().count('32/32') == 1  # masks, then chunks
    decoded = []
    monkeypatch.setattr(masks, '_values', lambda f: decoded.append(f) or [0])
    assert masks.mask_values(ready)[:3] == [[0], [1], [2]] and decoded == []
    Image.fromarray(np.full((2, 3), 2, np.uint8)).save(files[0])
    assert masks.mask_values(ready)[0] == [0] and decoded == [str(files[0])]  # a mask that changed is decoded again


def test_predicts_and_validation_keep_their_pipelines(scenes):
    "Masks: validation reads its masks, an unlabelled test_dl reads none, so they cannot share a pipeline; each keeps its own, built once, as they alternate"
    dls = loaders(scenes, [Resize(64)], bs=4)
    files = sorted((scenes/'images').glob('valid_*.png'))[:2]
    for _ in range(2):
        assert sum(len(y) for _,y in dls.valid) == N
        for f in files: assert [x.shape for x, in dls.test_dl([f])] == [(1, 3, 64, 64)]
    pipes = {id(s): s for s in [dls.valid._source] + [s for _,s in dls._fed_pipelines]}
    assert len(pipes) == 2 and all(s.builds == 1 for s in pipes.values()), [s.builds for s in pipes.values()]
