"""fastai's transforms translated to DALI give fastai's pixels with the same drawn parameters, and fastai's probabilities
and ranges with random ones; the keyword recipe reproduces today's pipelines; leftovers keep fastai's order and split_idx.

Tolerances: both sides resample bilinearly from the same pixel centres, so on smooth images (gradients, a few levels per
pixel) the outputs differ by rounding only: DALI warps uint8 images and rounds to whole levels (≤ 0.5 of 255), fastai
works in floats. `fn.resize` and PIL's antialiased resize differ by at most a level. Hence a maximum absolute difference
of 1.5 levels of 255; 4.5 where fastai first shrinks by area (`F.interpolate(mode='area')`, an exact box average) and
DALI by its antialiased linear resize (both average the same pixels with different weights: measured 4.1 levels at most
on these 5-levels-per-pixel ramps, 0.9 on average); 5 where fastai resamples three separate transforms (and reflects
at each) and DALI once."""
import math
import tempfile
from functools import partial
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from fastai.data.transforms import IntToFloatTensor, Normalize
from fastai.torch_core import TensorImage
from fastai.vision.augment import (Resize, RandomResizedCrop, RandomCrop, CropPad, Flip, Dihedral, Rotate, Zoom, Warp,
                                   FlipItem, DihedralItem, RandomErasing, Brightness, aug_transforms)
from fastai.vision.core import PILImage, image2tensor
from fastai.vision.data import imagenet_stats
from fasttransform import Transform
from nvidia.dali import fn
from nvidia.dali.pipeline import Pipeline

from dali_fastai.augment import synthetic_warps
from dali_fastai.pipeline import train_pipeline, valid_pipeline, read_files
from dali_fastai.translate import fastai_recipe
from dali_fastai.recipe import keyword_recipe, ImageRecipe

SIGMAS = 4.5


def gradient(h=48, w=48)->np.ndarray:
    "A smooth RGB image: ramps in x and y and a slow wave (interpolation differences stay small)"
    yy,xx = np.mgrid[:h, :w].astype(np.float64)
    return np.stack([255*xx/(w-1), 255*yy/(h-1), 127.5 + 100*np.sin(xx/w*3 + yy/h*2)], -1).round().astype(np.uint8)


@pytest.fixture(scope='module')
def folder():
    with tempfile.TemporaryDirectory() as d: yield Path(d)


def png(folder, img, name)->Path:
    Image.fromarray(img).save(folder/name)
    return folder/name


def recipe_out(recipe:ImageRecipe, files:list, output='images', seed=0)->np.ndarray:
    "One batch of `recipe.graph(...)[output]` over `files`, CPU backend"
    pipe = Pipeline(batch_size=len(files), num_threads=1, device_id=None, seed=seed)
    with pipe:
        encoded,_ = fn.readers.file(files=[str(f) for f in files], labels=list(range(len(files))))
        pipe.set_outputs(recipe.graph(encoded)[output])
    pipe.build()
    return np.array(pipe.run()[0].as_array())


def matrices(recipe:ImageRecipe, bs:int=400, batches:int=1, seed:int=1)->np.ndarray:
    "`[batches, bs, 3, 3]` per-sample matrices of `recipe` (no images needed)"
    pipe = Pipeline(batch_size=bs, num_threads=1, device_id=None, seed=seed)
    with pipe: pipe.set_outputs(recipe.matrix())
    pipe.build()
    return np.stack([np.array(pipe.run()[0].as_array()) for _ in range(batches)])


def fastai_out(img, item_tfms, batch_tfms, train:bool)->np.ndarray:
    "fastai's result on `img`, 0..1 floats CHW, transforms in `order` as a DataBlock runs them"
    split,x = (0 if train else 1),PILImage.create(img)
    for t in sorted(item_tfms, key=lambda t: t.order): x = t(x, split_idx=split)
    x = IntToFloatTensor()(TensorImage(image2tensor(x)[None]))
    for t in sorted(batch_tfms, key=lambda t: t.order): x = t(x, split_idx=split)
    return x[0].numpy()


def assert_matches(folder, img, item_tfms, batch_tfms, train, tol=1.5):
    ours = recipe_out(fastai_recipe(item_tfms, batch_tfms, train), [png(folder, img, 'x.png')])[0]
    ref = fastai_out(img, item_tfms, batch_tfms, train)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    diff = np.abs(ours - ref)*255
    assert diff.max() <= tol, f"max |DALI - fastai| = {diff.max():.2f} levels of 255 (mean {diff.mean():.3f}), tolerance {tol}"


# --- item transforms: valid is deterministic in fastai; a 48×64 image exercises crop, pad and both directions
ITEM_CASES = [Resize(32), Resize(32, method='squish'), Resize(32, method='pad'), Resize((24, 40), method='pad', pad_mode='zeros'),
              Resize((40, 24), method='pad', pad_mode='border'), Resize((40, 24), method='crop'), RandomResizedCrop(32),
              RandomResizedCrop((24, 40), val_xtra=0.3), CropPad(40), CropPad((70, 30), pad_mode='reflection'),
              CropPad((30, 70), pad_mode='border'), RandomCrop(40)]


@pytest.mark.parametrize('tfm', ITEM_CASES, ids=lambda t: f"{type(t).__name__}-{getattr(t, 'method', '')}-{t.size}")
def test_item_tfm_matches_fastai(folder, tfm):
    assert_matches(folder, gradient(48, 64), [tfm], [], train=False)


# --- batch transforms with fixed draws (p=1): a square image, so Resize(32)'s random window is the whole image
BATCH_CASES = {
    'rotate': [Rotate(p=1., draw=30, max_deg=45)],
    'rotate-zeros': [Rotate(p=1., draw=-20, pad_mode='zeros')],
    'rotate-border': [Rotate(p=1., draw=20, pad_mode='border')],
    'flip': [Flip(p=1., draw=1)],
    'no-flip': [Flip(p=1., draw=0)],
    'zoom': [Zoom(p=1., draw=1.3, draw_x=0.2, draw_y=0.7)],
    'warp': [Warp(p=1., draw_x=0.15, draw_y=-0.1)],
    'flip-size': [Flip(p=1., draw=1, size=(16, 24))],
    'separate': [Flip(p=1., draw=1), Rotate(p=1., draw=10), Zoom(p=1., draw=1.2, draw_x=0.3, draw_y=0.6)],
    **{f'dihedral-{k}': [Dihedral(p=1., draw=k)] for k in range(8)},
}


@pytest.mark.parametrize('name', list(BATCH_CASES))
def test_batch_tfm_matches_fastai(folder, name):
    assert_matches(folder, gradient(48, 48), [Resize(32)], BATCH_CASES[name], train=True,
                   tol=5. if name == 'separate' else 1.5)  # fastai resamples (and reflects) three times there, DALI once


def fixed_aug_transforms(**kw)->list:
    "`aug_transforms(**kw)` with every draw fixed and every p 1, as fastai composes it"
    tfms = aug_transforms(max_lighting=0., **kw)
    draws = {'flip_mat': 1, 'rotate_mat': 15, 'zoom_mat': 1.1, 'dihedral_mat': 5}
    aff = tfms[0]
    aff.aff_fs = [partial(f.func, **{**f.keywords, 'p': 1., 'draw': draws[f.func.__name__]}) for f in aff.aff_fs]
    for f in aff.aff_fs:
        if f.func.__name__ == 'zoom_mat': f.keywords.update(draw_x=0.2, draw_y=0.4)
    for c in aff.coord_fs: c.p,c.draw_x,c.draw_y = 1.,0.1,-0.05
    return tfms


@pytest.mark.parametrize('kw', [{}, dict(flip_vert=True), dict(size=(24, 20)), dict(pad_mode='zeros')], ids=str)
def test_composed_aug_transforms_match_fastai(folder, kw):
    "A rectangular image through fastai's composed affine + warp transform: `_prepare_mat` and the composition order"
    assert_matches(folder, gradient(32, 48), [Resize((32, 48))], fixed_aug_transforms(**kw), train=True)


@pytest.mark.parametrize('kw,tol', [(dict(size=(24, 20)), 4.5), (dict(size=16), 3.), (dict(size=(24, 20), min_scale=0.5), 4.5)],
                         ids=['size', 'shrink', 'min_scale'])
def test_aug_transforms_valid_resize_matches_fastai(folder, kw, tol):
    "On validation aug_transforms only resizes (and RandomResizedCropGPU centres its crop)"
    assert_matches(folder, gradient(48, 48), [Resize(48)], aug_transforms(**kw), train=False, tol=tol)


def test_item_flips_are_exact(folder):
    img = gradient(32, 32)
    ours = recipe_out(fastai_recipe([Resize(32), FlipItem(p=1.)], [], True), [png(folder, img, 'f.png')])[0]
    np.testing.assert_allclose(ours*255, img[:, ::-1].transpose(2, 0, 1), atol=1e-3)


# --- probabilities and ranges
def binomial_ok(k, n, p): return abs(k - n*p) <= SIGMAS*math.sqrt(n*p*(1 - p)) + 1


def test_each_step_has_its_own_coin_per_sample():
    "aug_transforms' flip, rotate and zoom each keep their draw with their own p, independently, per sample"
    m = matrices(fastai_recipe(Resize(32), aug_transforms(max_warp=0., max_lighting=0., min_zoom=1.2, max_zoom=1.5, p_affine=0.4),
                               train=True), bs=1000)[0]
    # the matrix is flip @ rotate @ zoom (scaled to pixels on a square: same structure): recover each draw
    a = m[:, :2, :2]
    scale = np.sqrt(np.abs(np.linalg.det(a)))
    flipped = np.linalg.det(a) < 0
    zoomed = scale < 1/1.2 + 1e-3
    r = a / scale[:, None, None] * np.where(flipped, -1, 1)[:, None, None]  # undo flip of x: the rotation part
    r[flipped, :, 0] *= -1
    r[flipped, :, :] = r[flipped, :, :] * np.array([[-1, 1], [-1, 1]])
    rotated = np.abs(np.degrees(np.arctan2(np.abs(a[:, 0, 1]), np.abs(a[:, 0, 0])))) > 1e-3
    n = len(m)
    assert binomial_ok(flipped.sum(), n, 0.5), flipped.sum()
    assert binomial_ok(zoomed.sum(), n, 0.4), zoomed.sum()
    assert binomial_ok(rotated.sum(), n, 0.4), rotated.sum()
    both = (zoomed & rotated).sum()
    assert binomial_ok(both, n, 0.16), f"rotate and zoom coins are not independent: {both} of {n} have both"
    zooms = 1/scale[zoomed]
    assert 1.2 - 1e-3 <= zooms.min() and zooms.max() <= 1.5 + 1e-3 and zooms.min() < 1.22 and zooms.max() > 1.48


def test_rotation_angles_uniform():
    m = matrices(fastai_recipe(Resize(32), [Rotate(max_deg=20, p=1.)], train=True), bs=1000)[0]
    deg = np.degrees(np.arctan2(m[:, 0, 1], m[:, 0, 0]))
    assert -20 - 1e-3 <= deg.min() < -19.5 and 19.5 < deg.max() <= 20 + 1e-3
    counts,_ = np.histogram(deg, bins=4, range=(-20, 20))
    assert all(binomial_ok(c, 1000, 0.25) for c in counts), counts


def test_dihedral_draws_every_symmetry():
    m = matrices(fastai_recipe(Resize(32), [Dihedral(p=0.5)], train=True), bs=800)[0]
    kinds,counts = np.unique(np.round(m[:, :2, :2]).reshape(-1, 4), axis=0, return_counts=True)
    assert len(kinds) == 8
    ident = counts[(kinds == [1, 0, 0, 1]).all(1)][0]
    assert binomial_ok(ident, 800, 0.5 + 0.5/8), ident


def test_warp_x_and_y_have_separate_coins():
    "fastai masks the warp's x and y each with p: both off (the identity) has probability (1-p)²"
    m = matrices(fastai_recipe(Resize(32), [Warp(magnitude=0.2, p=0.5)], train=True), bs=1000)[0]
    m = m / m[:, 2:, 2:]
    ident = np.all(np.abs(m - m[np.argmin(np.abs(m - np.eye(3)).sum((1, 2)))]) < 1e-5, axis=(1, 2))
    assert binomial_ok(ident.sum(), 1000, 0.25), ident.sum()


def test_batch_true_draws_once_per_batch():
    m = matrices(fastai_recipe(Resize(32), [Flip(p=0.5, batch=True), Rotate(p=1., batch=True)], train=True),
                 bs=16, batches=40)
    np.testing.assert_allclose(m, np.broadcast_to(m[:, :1], m.shape), atol=1e-6)
    flipped = (np.linalg.det(m[:, 0, :2, :2]) < 0).sum()
    assert binomial_ok(flipped, 40, 0.5), flipped


def test_valid_never_augments():
    r = fastai_recipe(Resize(32), aug_transforms(), train=False)
    assert r.matrix() is None or np.allclose(r.matrix(), np.eye(3))


def test_random_crop_windows(folder):
    "Resize's training window: random position, fastai's size; RandomResizedCrop's: inside the image, area in range"
    files = [png(folder, gradient(40, 80), 'w.png')]*200
    w = recipe_out(fastai_recipe(Resize(32), [], True), files, 'window')
    np.testing.assert_allclose(w[:, 2:] - w[:, :2], np.broadcast_to([40, 40], (200, 2)))
    assert w[:, 1].max() == 0 and w[:, 0].min() == 0 and w[:, 0].max() == 39 and len(set(w[:, 0])) > 30  # int(U[0,1)·40)
    w = recipe_out(fastai_recipe(RandomResizedCrop(32, min_scale=0.3), [], True), files, 'window')
    area = (w[:, 2] - w[:, 0])*(w[:, 3] - w[:, 1])/(40*80)
    assert w.min() >= 0 and (w[:, 2] <= 80).all() and (w[:, 3] <= 40).all()
    assert 0.29 <= area.min() and area.max() <= 1.0001


# --- keyword dialect
@pytest.mark.parametrize('train', [True, False])
def test_keyword_recipe_reproduces_todays_pipelines(folder, train):
    files = [png(folder, gradient(40 + 3*i, 56 - 2*i), f'k{i}.png') for i in range(6)]
    aug = dict(warps=synthetic_warps(7, seed=0), p_rotate=0.5, p_warp=0.3, max_lighting=0.2) if train else {}
    pipe = (train_pipeline if train else valid_pipeline)(files, [0]*6, 6, size=24, seed=5, shuffle=False, num_threads=1, **aug)
    pipe.build()
    ref = [np.array(pipe.run()[0].as_array()) for _ in range(2)]
    ours = Pipeline(batch_size=6, num_threads=1, device_id=None, seed=5, enable_checkpointing=True)
    with ours:
        encoded,labels = read_files(files, [0]*6)
        ours.set_outputs(keyword_recipe(train, 24, **aug).build(encoded), labels)
    ours.build()
    for r in ref: np.testing.assert_array_equal(np.array(ours.run()[0].as_array()), r)


def test_keyword_recipe_rectangular(folder):
    files = [png(folder, gradient(40, 56), 'r.png')]*2
    for train in (True, False):
        aug = dict(warps=synthetic_warps(3, seed=0), p_warp=0.5, p_rotate=0.5) if train else {}
        assert recipe_out(keyword_recipe(train, (20, 30), **aug), files).shape == (2, 3, 20, 30)
    with pytest.raises(ValueError, match='only apply to a train=True recipe'): keyword_recipe(False, 24, p_hflip=0.5)


# --- leftovers, describe, split_idx
class Darken(Transform):
    "A user's batch transform with no DALI equivalent, train-only"
    order,split_idx = 35,0
    def encodes(self, x:TensorImage): return x*0.9


def test_leftovers_keep_fastais_order():
    r = fastai_recipe(Resize(32), aug_transforms() + [Darken(), RandomErasing(), Normalize.from_stats(*imagenet_stats)], True)
    rows = dict(r.describe())
    assert rows['Flip'].startswith('matrix') and rows['Warp'].startswith('matrix')
    assert rows['Darken'] == 'runs in fastai (train only)' and rows['RandomErasing'] == 'runs in fastai (train only)'
    assert rows['Normalize'] == 'runs in fastai' and r.mean is None
    names = [type(t).__name__ for t in r.fastai_tfms]
    assert names.index('Darken') < names.index('Normalize') < names.index('RandomErasing')


def test_leftover_after_normalize_leaves_normalize_compiled():
    r = fastai_recipe(Resize(32), [Flip(), Normalize.from_stats(*imagenet_stats), RandomErasing()], True)
    assert [type(t).__name__ for t in r.fastai_tfms] == ['RandomErasing']
    assert np.allclose(r.mean, imagenet_stats[0])
    n = r.with_normalize(*imagenet_stats)
    assert n.fastai_tfms == r.fastai_tfms and np.allclose(n.std, imagenet_stats[1])


def test_valid_drops_train_only_leftovers():
    r = fastai_recipe(Resize(32), [Darken(), Normalize.from_stats(*imagenet_stats)], False)
    assert r.fastai_tfms == [] and dict(r.describe())['Darken'] == 'skipped (train only)'


def test_item_tfm_on_batches_runs_in_fastai_with_everything_after():
    r = fastai_recipe([Resize(32), Darken()], [Flip()], True)
    assert [type(t).__name__ for t in r.fastai_tfms] == ['Darken', 'Flip'] and r.geometry == []


def test_draw_lists_compile_as_fastai_draws_them():
    "A per-sample draw list: fastai's own functions draw on the host, so sample i gets the list's i-th value, every batch"
    r = fastai_recipe(Resize(32), [Rotate(p=1., draw=[10, 20])], True)
    assert r.fastai_tfms == []
    m = matrices(r, bs=2, batches=2)
    deg = np.degrees(np.arctan2(m[..., 0, 1], m[..., 0, 0]))
    np.testing.assert_allclose(deg, [[10, 20], [10, 20]], atol=1e-4)


def test_draw_list_shorter_than_the_batch_is_a_clear_error():
    "fastai asserts without a word; here the graph refuses to build, naming the transform and the count"
    for tfms,what in (([Rotate(p=1., draw=[10, 20])], "Rotate's `draw`"), ([Warp(p=1., draw_x=[0.1])], "Warp's `draw_x`"),
                      ([Brightness(p=1., draw=[0.4, 0.6])], "Brightness's per-sample `draw`")):
        with pytest.raises(ValueError, match=f"{what} needs one value per sample: got .* values for batches of 4"):
            recipe_out(fastai_recipe(Resize(32), tfms, True), [Path('never-read.jpg')]*4)


def test_draw_functions_run_in_fastai():
    "A draw that is a function of fastai's batch would see a stand-in with no pixels: left to fastai"
    r = fastai_recipe(Resize(32), [Rotate(p=1., draw=lambda x: x.new_ones(x.size(0)))], True)
    assert [type(t).__name__ for t in r.fastai_tfms] == ['Rotate']


def test_lighting_translates_or_stays_in_fastai():
    "Brightness compiles when dali_fastai.colour is there; otherwise it (and what follows) runs in fastai"
    r = fastai_recipe(Resize(32), [Brightness(p=1.), Normalize.from_stats(*imagenet_stats)], True)
    try: import dali_fastai.colour  # noqa: F401
    except ImportError:
        assert [type(t).__name__ for t in r.fastai_tfms] == ['Brightness', 'Normalize']
    else:
        assert r.fastai_tfms == [] and len(r.colour) == 1


def batch_matrices(recipe, bs=4, batches=6, seed=0)->list:
    "The recipe's per-sample matrices (output pixels → item pixels) of `batches` batches of a CPU pipeline"
    pipe = Pipeline(batch_size=bs, num_threads=1, device_id=None, seed=seed)
    with pipe: pipe.set_outputs(recipe.matrix())
    pipe.build()
    return [np.array(pipe.run()[0].as_array()) for _ in range(batches)]


def test_batch_true_geometry_is_drawn_a_batch_at_a_time():
    "Draws that fastai makes per sample come 8 batches a call; a `batch=True` coin stays one per batch, new each batch"
    from dali_fastai.steps import GeometryStep
    from fastai.vision.augment import AffineCoordTfm, RandomResizedCropGPU
    assert all(GeometryStep(t, True).alone for t in aug_transforms() if isinstance(t, AffineCoordTfm))
    assert not any(GeometryStep(t, True).alone for t in aug_transforms(batch=True) if isinstance(t, AffineCoordTfm))
    assert not GeometryStep(Rotate(draw=[10.]*4), True).alone and not GeometryStep(RandomResizedCropGPU(16), True).alone
    flips = [m[:, 0, 0] < 0 for m in batch_matrices(fastai_recipe(Resize(16), [Flip(p=0.5, batch=True)], train=True))]
    assert all((f == f[0]).all() for f in flips), "samples of one batch flipped differently with batch=True"
    assert len({bool(f[0]) for f in flips}) == 2, "every batch flipped alike: the batch coin was drawn once for several"
