"""The README's default augmentation table, checked through the loader's own path.

Every test builds a `DaliDataLoader(train=True)` (on the CPU; on the GPU under `make gpu-test`) and passes only what it
must switch off, so the defaults under test come from the loader itself (`compose=True`: one resample, vertical flip
and fixed warps drawn together as one subset). The images are `helpers.make_coordinate_image`s: their red and green are the pixel's coordinates, so the
affine map each sample was read through (crop, resize, flips, warps, rotation) is fitted back from its output
(`helpers.source_maps`). `test_augment_stats.py` checks the graph pieces (`affine_steps`) one by one; this file checks
what a user of the loader gets. `tools/mutants.py` plants a wrong default for every row and checks a test here fails."""
import os

import numpy as np
import pytest
import torch

from dali_fastai.loader import DaliDataLoader, ImageItems
from helpers import make_coordinate_image, source_maps, IMAGENET_MEAN, IMAGENET_STD

SIDE,SIZE = 64,32  # the image, and the loader's output: a map with no crop and no augmentation is 2·identity
N,BS = 2000,500
SIGMAS = 4.5
FIXED = dict(area=(1., 1.), ratio=(1., 1.))  # the whole image, resized: no crop
# CPU by default; `make gpu-test` runs this file again with DALI_FASTAI_TEST_DEVICE=gpu (README: same behaviour on both)
DEVICE = os.environ.get('DALI_FASTAI_TEST_DEVICE', 'cpu')


@pytest.fixture(scope='module')
def image(tmp_path_factory): return make_coordinate_image(tmp_path_factory.mktemp('coords')/'c.png', SIDE)


def loader(image, n=N, bs=BS, size=SIZE, **kw)->DaliDataLoader:
    return DaliDataLoader(ImageItems([image]*n, [0]*n, ['a']), bs=bs, size=size, train=True, device=DEVICE, **kw)


def maps(image, seed, **kw)->np.ndarray:
    "`[N, 2, 3]`: per sample, output pixel → source pixel, over one epoch of a `loader` with `kw` changed"
    return np.concatenate([source_maps(x.cpu()) for x,_ in loader(image, seed=seed, **kw)])


def assert_binomial(k, n, p, what):
    mean,sd = n*p,np.sqrt(n*p*(1 - p))
    assert abs(k - mean) <= SIGMAS*sd + 1, f"{what}: {k} of {n}, expected {mean:.1f} ± {SIGMAS}·{sd:.1f}"


def flips(ms):
    "(hflip, vflip) of each sample: the signs of the diagonal (crop scales are positive, warps and ±7° keep it positive)"
    return ms[:, 0, 0] < 0,ms[:, 1, 1] < 0


def unflipped(ms):
    "The linear part with the flips taken out, in size-pixel units: vflip · N · hflip = M, so N = vflip · M · hflip"
    h,v = flips(ms)
    m = ms[:, :, :2]*(SIZE/SIDE)
    m[:, :, 0] *= np.where(h, -1., 1.)[:, None]  # the horizontal flip (on the right) negates column 0
    m[:, 1, :] *= np.where(v, -1., 1.)[:, None]  # the vertical flip (on the left) negates row 1
    return m


def test_maps_are_read_back_exactly(image):
    "The measuring tool: with every augmentation off, the map is the plain 2× resize, to 1e-3"
    m = maps(image, 0, n=8, bs=8, p_hflip=0., p_vflip=0., p_rotate=0., warp_mode=None, **FIXED)
    np.testing.assert_allclose(m, np.broadcast_to([[2., 0., 0.], [0., 2., 0.]], m.shape), atol=1e-3)


# ---------------------------------------------------------------- flips and the 7 fixed warps (folded together)

P_ANY_WARP = 1 - 0.975**7


@pytest.fixture(scope='module')
def flips_and_warps(image):
    "Default flips and fixed warps (rotation and crop off)"
    ms = maps(image, 1, p_rotate=0., **FIXED)
    return flips(ms),unflipped(ms)


def test_default_flip_rates(flips_and_warps):
    (h,v),_ = flips_and_warps
    assert_binomial(h.sum(), N, 0.5, 'hflip (README: p=0.5)')
    assert_binomial(v.sum(), N, 0.1, 'vflip (README: p=0.1)')
    assert_binomial((h & v).sum(), N, 0.05, 'both flips (independent coins)')


def test_default_fixed_warps(flips_and_warps):
    "7 fixed warps `warp_matrix(x, y)`, x, y in ±0.1, each with p=0.025 per sample, independent of the vertical flip"
    (_,v),m = flips_and_warps
    warped = np.abs(m - np.eye(2)).max((1, 2)) > 1e-3
    assert_binomial(warped.sum(), N, P_ANY_WARP, 'samples with at least one warp (7 warps, p=0.025 each)')
    assert_binomial((warped & v).sum(), N, P_ANY_WARP*0.1, 'warped and flipped vertically')
    w = m[warped]
    xy,inverse,counts = np.unique(np.round(w[:, [0, 1], [1, 0]]/2, 3), axis=0, return_inverse=True, return_counts=True)
    order = np.argsort(-counts)
    # one warp alone: p·(1-p)^6 of the samples each (~43); two at once: ~1 sample per pair
    assert (counts > 15).sum() == 7, f"the 7 warps each alone: counts of the distinct warps are {counts[order].tolist()}"
    for k in counts[order[:7]]: assert_binomial(k, N, 0.025*0.975**6, 'one given warp, alone')
    # `warp_matrix(x, y)` is I + 2·(x, y)ᵀ(1, 1): it keeps (1, -1)
    alone = w[np.isin(inverse.ravel(), order[:7])]
    np.testing.assert_allclose(alone @ [1., -1.], np.broadcast_to([1., -1.], (len(alone), 2)), atol=2e-3)
    xy = xy[order]
    seven = xy[:7]
    assert np.abs(seven).max() <= 0.1 + 2e-3, f"warp x, y beyond the magnitude 0.1: {seven.tolist()}"
    assert np.abs(seven).max() > 0.05, f"warp x, y all within ±0.05 (magnitude 0.1 expected): {seven.tolist()}"


def test_default_random_warps(image):
    "warp_mode='random': 7 warps per sample (n_warps), each with p=0.025, x and y drawn per sample from ±0.1"
    (_,v),m = flips(ms := maps(image, 4, warp_mode='random', p_rotate=0., **FIXED)),unflipped(ms)
    warped = np.abs(m - np.eye(2)).max((1, 2)) > 1e-3
    assert_binomial(warped.sum(), N, P_ANY_WARP, 'samples with at least one random warp')
    w = m[warped]
    np.testing.assert_allclose(np.median(np.abs(w @ [1., -1.] - [1., -1.]), 0), 0, atol=2e-3, err_msg="warp_matrix form")
    assert len(np.unique(np.round(w[:, [0, 1], [1, 0]]/2, 3), axis=0)) > 0.8*len(w), "every sample draws its own warp"
    xy = np.abs(w[:, [0, 1], [1, 0]]/2).max(1)
    # a product of two warps may reach beyond 0.1; one warp (most samples) stays within it
    assert (xy > 0.1 + 2e-3).mean() < 0.1 and xy.max() > 0.08, f"|x|, |y| beyond 0.1: {(xy > 0.102).mean():.2f}"


# ---------------------------------------------------------------- the coin-flip rotation

def test_default_rotation(image):
    "p=0.075, angle ~ U(-7°, 7°), counter-clockwise, a pure rotation about the centre"
    ms = maps(image, 2, warp_mode=None, **FIXED)
    m = unflipped(ms)
    angle = np.degrees(np.arctan2(m[:, 1, 0], m[:, 0, 0]))
    on = np.abs(angle) > 0.02
    assert_binomial(on.sum(), N, 0.075, 'rotated samples (README: p=0.075)')
    a = angle[on]
    assert a.min() >= -7.05 and a.max() <= 7.05, f"angles outside ±7°: {a.min():.2f} .. {a.max():.2f}"
    assert a.min() < -6 and a.max() > 6, f"angles do not reach ±7°: {a.min():.2f} .. {a.max():.2f}"
    u = np.sort((a + 7)/14)
    ks = max(np.max(np.arange(1, len(u) + 1)/len(u) - u), np.max(u - np.arange(len(u))/len(u)))
    assert ks < np.sqrt(-np.log(1e-4/2)/(2*len(u))), f"angles not uniform in ±7° (KS distance {ks:.3f})"
    rot = np.stack([np.cos(np.radians(a)), -np.sin(np.radians(a)), np.sin(np.radians(a)), np.cos(np.radians(a))], 1)
    np.testing.assert_allclose(m[on].reshape(-1, 4), rot, atol=5e-3, err_msg="a rotation, nothing else")
    # about the centre: the output centre reads the image centre (after the flips, which also keep the centre)
    np.testing.assert_allclose(ms[on][:, :, :2] @ [SIZE/2, SIZE/2] + ms[on][:, :, 2], SIDE/2, atol=0.05)


# ---------------------------------------------------------------- everything at its default

@pytest.fixture(scope='module')
def all_defaults(image): return maps(image, 3)


def test_all_defaults_together(all_defaults):
    "Nothing switched off: flips at their rates, and rotation or a warp (skewing the map) on 1 - 0.925·0.975⁷ of samples"
    h,v = flips(all_defaults)
    assert_binomial(h.sum(), N, 0.5, 'hflip')
    assert_binomial(v.sum(), N, 0.1, 'vflip')
    skewed = np.abs(all_defaults[:, [0, 1], [1, 0]]).max(1) > 1e-3
    assert_binomial(skewed.sum(), N, 1 - 0.925*0.975**7, 'rotated or warped')


def test_default_random_resized_crop(all_defaults):
    "fastai's RandomResizedCrop bounds: area 0.08–1 of the image, aspect ratio 3/4–4/3, the window inside the image"
    m = all_defaults[np.abs(all_defaults[:, [0, 1], [1, 0]]).max(1) <= 1e-3]  # crop and flips only
    w,h = np.abs(m[:, 0, 0])*SIZE,np.abs(m[:, 1, 1])*SIZE
    area,ratio = w*h/SIDE**2,w/h
    assert area.min() >= 0.08 - 0.005 and area.max() <= 1 + 1e-3, f"area {area.min():.3f} .. {area.max():.3f}"
    assert area.min() < 0.1 and area.max() > 0.95, f"area does not cover 0.08–1: {area.min():.3f} .. {area.max():.3f}"
    assert ratio.min() >= 3/4 - 0.01 and ratio.max() <= 4/3 + 0.01, f"ratio {ratio.min():.3f} .. {ratio.max():.3f}"
    assert ratio.min() < 0.77 and ratio.max() > 1.3, f"ratio does not cover 3/4–4/3: {ratio.min():.3f} .. {ratio.max():.3f}"
    corners = m @ np.array([[0., 0., 1.], [SIZE, 0., 1.], [0., SIZE, 1.], [SIZE, SIZE, 1.]]).T
    assert corners.min() >= -0.5 and corners.max() <= SIDE + 0.5, "the crop window lies inside the image"


# ---------------------------------------------------------------- padding, validation crop, normalization

def test_default_pad_mode_is_reflection(image):
    "Pixels read from outside the image mirror it (README: reflection), not zeros (black) or the edge's colour"
    x, = [x for x,_ in loader(image, n=1, bs=1, seed=0, p_hflip=0., p_vflip=0., warp_mode=None, p_rotate=1.,
                              rotate_range=(45., 45.), **FIXED)]
    x = x.cpu()
    m = source_maps(x)[0]
    p = (x[0].float()*torch.tensor(IMAGENET_STD).view(3, 1, 1) + torch.tensor(IMAGENET_MEAN).view(3, 1, 1))*255
    src = m @ [0.5, 0.5, 1.]  # the top-left pixel's centre, read from outside the image
    assert src.min() < -5, f"the test reads outside the image: {src}"
    folded = np.where(src < 0, -src, np.where(src > SIDE, 2*SIDE - src, src))
    got = p[:2, 0, 0].numpy()/4
    assert abs(p[2, 0, 0] - 200) < 3, f"blue {p[2, 0, 0]:.0f} at the corner: padded with zeros, not reflected"
    np.testing.assert_allclose(got, folded, atol=1.5, err_msg=f"the corner reads {got}, the mirror image of {src}")


def test_default_valid_centre_crop(image):
    "Validation resizes the shorter side to size/0.875 and keeps the centre (README: crop_pct 0.875)"
    dl = DaliDataLoader(ImageItems([image], [0], ['a']), bs=1, size=28, device=DEVICE)
    m = source_maps(dl.one_batch()[0].cpu())[0]
    np.testing.assert_allclose(m[:, :2], 2*np.eye(2), atol=1e-3)  # 64 px → 32 (28/0.875), no flip
    np.testing.assert_allclose(m[:, :2]@[28, 28]/SIDE, [0.875, 0.875], atol=1e-3, err_msg="the window's share")
    np.testing.assert_allclose(m @ [14, 14, 1], [SIDE/2, SIDE/2], atol=0.05, err_msg="the window's centre")


@pytest.mark.parametrize('train', [False, True], ids=['valid', 'train'])
def test_default_normalization_is_imagenet(tmp_path, train):
    "float32 CHW, (pixel/255 - ImageNet mean) / ImageNet std, and `decode` gives the pixels back"
    from PIL import Image
    colour = (200, 40, 90)
    f = tmp_path/'solid.png'
    Image.new('RGB', (16, 16), colour).save(f)
    dl = DaliDataLoader(ImageItems([f], [0], ['a']), bs=1, size=8, device=DEVICE, train=train, seed=0)
    x,_ = dl.one_batch()
    x = x.cpu()
    assert x.dtype == torch.float32 and x.shape == (1, 3, 8, 8)
    expected = [(c/255 - m)/s for c,m,s in zip(colour, IMAGENET_MEAN, IMAGENET_STD)]
    np.testing.assert_allclose(x[0].mean((1, 2)).numpy(), expected, atol=1e-3)
    np.testing.assert_allclose(dl.decode((x, torch.tensor([0])))[0][0].mean((1, 2)).cpu().numpy(), np.array(colour)/255,
                               atol=1e-3)


def test_default_composes_one_resample(image):
    "compose=True by default: a warp and a rotation are one resample (step by step, the corners read other pixels)"
    kw = dict(n=1, bs=1, seed=0, p_hflip=0., p_vflip=0., p_rotate=1., rotate_range=(30., 30.), n_warps=1, p_warp=1.,
              **FIXED)
    def batch(**k): return next(iter(loader(image, **kw, **k)))[0].cpu()
    default,composed,stepwise = batch(),batch(compose=True),batch(compose=False)
    assert torch.equal(default, composed)
    assert (composed - stepwise).abs().max() > 0.1, "the test tells one resample from two"
