"""fastai's lighting transforms compiled into DALI (`dali_fastai.colour`): the same pixels as fastai for fixed draws,
fastai's distributions and probabilities for random ones (per sample, independent, or one per batch), clear refusals."""
import numpy as np
import pytest
import torch
from fastai.torch_core import TensorImage
from fastai.vision.augment import (Brightness, Contrast, Saturation, Hue, LightingTfm, aug_transforms,
                                   _BrightnessLogit, _ContrastLogit, _SaturationLogit)
from nvidia.dali import fn, pipeline_def
from nvidia.dali.pipeline import Pipeline

from helpers import needs_gpu
from dali_fastai.colour import COLOUR_TFMS, colour_batch, colour_nodes, colour_unsupported, lighting_draws
from dali_fastai.draws import HostDraws

N = 400        # samples for the statistics
SIGMAS = 4.5
EPS = 2e-6     # DALI vs fastai: a few float32 roundings of values <= 1 (measured: <= 1.2e-7)


def run(make, bs=N, seed=0, batches=1, images=None)->list:
    "`batches` runs of a CPU pipeline returning `make(images_node)`: a list (per batch) of lists of arrays `[bs, ...]`"
    feed = None if images is None else [list(np.ascontiguousarray(images, dtype=np.float32))]
    @pipeline_def(batch_size=bs if images is None else len(images), num_threads=1, device_id=None, seed=seed)
    def pipe():
        x = None if feed is None else fn.external_source(source=feed, cycle=True)
        res = make(x)
        return res if isinstance(res, tuple) else (res,)
    p = pipe(); p.build()
    return [[np.array(o.as_array()) for o in p.run()] for _ in range(batches)]


def fastai_batch(images, tfm)->np.ndarray:
    "fastai's output for `tfm` on a NumPy batch `[n, h, w, 3]`"
    x = TensorImage(torch.from_numpy(np.ascontiguousarray(images.transpose(0, 3, 1, 2))).clone())
    return tfm(x, split_idx=0).numpy().transpose(0, 2, 3, 1)


def sample_images(h=16, w=24, seed=0)->np.ndarray:
    "A smooth image with pure black, white, primary and grey pixels in a corner, flipped, and noise: `[3, h, w, 3]`"
    yy, xx = np.mgrid[0:h, 0:w]
    yy, xx = yy/(h - 1), xx/(w - 1)
    smooth = np.stack([xx, yy, 0.5 + 0.4*np.sin(6*xx*yy)], -1).astype(np.float32)
    smooth[0, :8] = [[0, 0, 0], [1, 1, 1], [1, 0, 0], [0, 1, 0], [0, 0, 1], [1, 1, 0], [0, 1, 1], [.3, .3, .3]]
    return np.stack([smooth, smooth[::-1], np.random.default_rng(seed).random((h, w, 3), dtype=np.float32)])


def assert_binomial(k:int, n:int, p:float, what:str):
    mean, sd = n*p, np.sqrt(n*p*(1 - p))
    assert abs(k - mean) <= SIGMAS*sd + 1, f"{what}: {k} of {n}, expected {mean:.1f} ± {SIGMAS}·{sd:.1f}"


def assert_uniform(x, lo, hi, what):
    "Kolmogorov-Smirnov test (alpha 1e-4) of `x` against U(lo, hi), and the range is reached but not left"
    u = np.sort((np.asarray(x, dtype=np.float64) - lo)/(hi - lo))
    n = len(u)
    d = max(np.max(np.arange(1, n + 1)/n - u), np.max(u - np.arange(n)/n))
    crit = np.sqrt(-np.log(1e-4/2)/(2*n))
    assert d < crit, f"{what}: KS distance {d:.4f} to U({lo:.4f}, {hi:.4f}) >= {crit:.4f} (n={n})"
    assert lo - 1e-5 <= u.min()*(hi - lo) + lo and u.max()*(hi - lo) + lo <= hi + 1e-5, f"{what}: outside [{lo}, {hi}]"
    assert u.min() < 0.05 and u.max() > 0.95, f"{what}: does not reach the ends of [{lo}, {hi}]"


def logit(x): return np.log(x) - np.log1p(-x)


# ---------------------------------------------------------------- the same pixels as fastai

def composed(*tfms):
    "fastai's composition of lighting transforms, as `setup_aug_tfms` does it"
    res = tfms[0]
    for t in tfms[1:]: res.compose(t)
    return res


FIXED = {
    'brightness': lambda: Brightness(max_lighting=0.5, p=1., draw=0.72),
    'brightness-dark': lambda: Brightness(p=1., draw=0.1),
    'contrast': lambda: Contrast(p=1., draw=1.8),
    'contrast-low': lambda: Contrast(p=1., draw=0.4),
    'saturation': lambda: Saturation(p=1., draw=0.3),
    'saturation-over': lambda: Saturation(p=1., draw=2.5),
    'hue': lambda: Hue(p=1., draw=1.07),
    'hue-back': lambda: Hue(p=1., draw=0.61),
    'hue-negative': lambda: Hue(p=1., draw=-0.2),
    'per-sample': lambda: Brightness(p=1., draw=[0.3, 0.5, 0.9, 0.1]),
    'per-sample-tensor': lambda: Contrast(p=1., draw=torch.tensor([0.7, 1.0, 1.3])),
    'batch': lambda: Saturation(p=1., draw=0.5, batch=True),
    'all-three': lambda: composed(Brightness(p=1., draw=0.4), Contrast(p=1., draw=1.5), Saturation(p=1., draw=1.6)),
}


@pytest.mark.parametrize('name', list(FIXED))
def test_matches_fastai(name):
    ims = sample_images()
    tfm = FIXED[name]()
    ours, theirs = colour_batch(ims, tfm), fastai_batch(ims, tfm)
    assert np.abs(ours - theirs).max() <= EPS, f"{name}: max |DALI - fastai| = {np.abs(ours - theirs).max():.2e}"
    assert np.abs(ours - ims).max() > 0.05, f"{name} changed nothing"


def test_aug_transforms_lighting_matches_fastai():
    lighting = aug_transforms(max_lighting=0.3, p_lighting=1.)[-1]
    assert [type(f) for f in lighting.fs] == [_BrightnessLogit, _ContrastLogit]
    lighting.fs[0].draw, lighting.fs[1].draw = 0.35, 1.3
    ims = sample_images()
    assert np.abs(colour_batch(ims, lighting) - fastai_batch(ims, lighting)).max() <= EPS


def test_list_of_transforms_in_order():
    ims = sample_images()
    tfms = [Hue(p=1., draw=0.9), Brightness(p=1., draw=0.6)]
    ref = fastai_batch(fastai_batch(ims, tfms[0]), tfms[1])
    assert np.abs(colour_batch(ims, tfms) - ref).max() <= EPS


@pytest.mark.parametrize('tfm', [Brightness(p=0.), Contrast(p=0.), Saturation(p=0.), Hue(p=0.),
                                 Brightness(p=0., batch=True), Hue(p=0., batch=True)], ids=str)
def test_coin_zero_leaves_images_alone(tfm):
    ims = sample_images()
    ours = colour_batch(ims, tfm)
    assert np.abs(ours - fastai_batch(ims, tfm)).max() <= EPS
    # fastai's logit clamp moves 0 and 1 by 1e-7; its HSV round trip moves values by up to 7e-7
    assert np.abs(ours - ims).max() <= 1e-6


# ---------------------------------------------------------------- fastai's draws, through the pipeline's host draws

def changes(tfm):
    "A node: each sample's `change` of `tfm`'s one function, as fastai draws it (brightness back from `power_form`'s `E`)"
    draws = HostDraws()
    k = draws.add(lighting_draws(tfm, Pipeline.current().max_batch_size))
    terms = draws.nodes()[k]
    # brightness alone: E = exp(-logit(change)), so change = 1/(1 + E); contrast alone: A = change; the others: the change
    return 1/(1 + terms[1]) if isinstance(tfm.fs[0], _BrightnessLogit) else terms[0]


M = 0.4


def log_uniform_range(m): return np.log(1 - m), -np.log(1 - m)


DRAWS = {  # function, the draw's distribution (as a uniform on some scale), its neutral value
    'brightness': (lambda p, b: Brightness(max_lighting=M, p=p, batch=b), (0.5*(1 - M), 0.5*(1 + M)), None, 0.5),
    'contrast': (lambda p, b: Contrast(max_lighting=M, p=p, batch=b), log_uniform_range(M), np.log, 1.),
    'saturation': (lambda p, b: Saturation(max_lighting=M, p=p, batch=b), log_uniform_range(M), np.log, 1.),
    'hue': (lambda p, b: Hue(max_hue=M, p=p, batch=b), log_uniform_range(M), np.log, 0.),
}


@pytest.mark.parametrize('name', list(DRAWS))
def test_draw_distribution(name):
    make, (lo, hi), scale, _ = DRAWS[name]
    (c,), = run(lambda _: changes(make(1., False)))
    assert_uniform(c if scale is None else scale(c), lo, hi, name)


@pytest.mark.parametrize('p', [0.2, 0.75])
@pytest.mark.parametrize('name', list(DRAWS))
def test_probability_per_sample(name, p):
    make, _, _, neutral = DRAWS[name]
    (c,), = run(lambda _: changes(make(p, False)))
    applied = np.abs(c - neutral) > 1e-6
    assert_binomial(applied.sum(), N, p, f"{name} p={p}")
    # independent across samples: neighbours agree as often as two independent coins do
    assert_binomial((applied[1:] == applied[:-1]).sum(), N - 1, p*p + (1 - p)*(1 - p), f"{name}: neighbours")


@pytest.mark.parametrize('name', list(DRAWS))
def test_batch_true_draws_once_per_batch(name):
    make, (lo, hi), scale, neutral = DRAWS[name]
    p, n_batches = 0.6, 150
    outs = run(lambda _: changes(make(p, True)), bs=4, batches=n_batches)
    c = np.stack([o[0] for o in outs])                       # [batches, bs]
    assert (c == c[:, :1]).all(), f"{name}: samples of one batch differ with batch=True"
    applied = np.abs(c[:, 0] - neutral) > 1e-6
    assert_binomial(applied.sum(), n_batches, p, f"{name}: batches changed")
    v = c[applied, 0]
    assert len(set(v.tolist())) == len(v), f"{name}: batches share values"
    v = v if scale is None else scale(v)
    assert lo - 1e-5 <= v.min() and v.max() <= hi + 1e-5


@pytest.mark.parametrize('tfm', [Brightness(p=0.3), Contrast(p=0.3), Saturation(p=0.3), Hue(p=0.3)],
                         ids=lambda t: type(t).__name__)
def test_probability_through_the_node(tfm):
    "A saturated, off-centre colour shows every change; each sample is changed with probability p, on its own"
    im = np.full((N, 1, 1, 3), [0.8, 0.3, 0.2], dtype=np.float32)
    (out,), = run(lambda x: colour_nodes(x, [tfm]), images=im)
    changed = np.abs(out - im).reshape(N, -1).max(1) > 1e-5
    assert_binomial(changed.sum(), N, 0.3, f"{type(tfm).__name__}: samples changed")
    assert_binomial((changed[1:] == changed[:-1]).sum(), N - 1, 0.3**2 + 0.7**2, f"{type(tfm).__name__}: neighbours")


def test_brightness_and_contrast_coins_independent_through_the_node():
    "Two pixels recover each sample's brightness `b` and contrast `c` from aug_transforms' composed lighting"
    p = 0.5
    lighting = aug_transforms(max_lighting=M, p_lighting=p)[-1]
    im = np.array([[[0.5]*3, [1/(1 + np.exp(-1))]*3]], dtype=np.float32)       # logits 0 and 1
    (out,), = run(lambda x: colour_nodes(x, [lighting]), images=np.repeat(im[None], N, axis=0))
    l0, l1 = logit(out[:, 0, 0, 0].astype(np.float64)), logit(out[:, 0, 1, 0].astype(np.float64))
    c = l1 - l0                     # (0 + logit(b))·c and (1 + logit(b))·c
    lb = l0/c
    b_on, c_on = np.abs(lb) > 1e-4, np.abs(c - 1) > 1e-4
    assert_binomial(b_on.sum(), N, p, "brightness applied")
    assert_binomial(c_on.sum(), N, p, "contrast applied")
    assert_binomial((b_on & c_on).sum(), N, p*p, "both applied (independent coins)")
    assert_uniform(1/(1 + np.exp(-lb[b_on])), 0.5*(1 - M), 0.5*(1 + M), "brightness change")
    assert_uniform(np.log(c[c_on]), *log_uniform_range(M), "log contrast change")


def test_new_values_every_batch_and_seed():
    tfm = Brightness(p=1.)
    a, b = run(lambda _: changes(tfm), bs=8, batches=2)
    assert not np.allclose(a[0], b[0]), "the same draws in two batches"
    again, _ = run(lambda _: changes(tfm), bs=8, batches=2)
    np.testing.assert_array_equal(a[0], again[0])
    other, = run(lambda _: changes(tfm), bs=8, seed=1)
    assert not np.allclose(a[0], other[0]), "another seed, the same draws"


# ---------------------------------------------------------------- what cannot be compiled, said clearly

def test_handles_the_four():
    assert all(colour_unsupported(t()) is None for t in COLOUR_TFMS)
    assert colour_unsupported(aug_transforms()[-1]) is None


def test_refuses_a_draw_function():
    tfm = Brightness(draw=lambda x: x.new_ones(x.size(0))*0.6)
    assert 'cannot call' in colour_unsupported(tfm)
    with pytest.raises(ValueError, match="cannot compile Brightness into DALI: draw=.* is a function of fastai's batch tensor"):
        colour_batch(sample_images(), tfm)


def test_refuses_unknown_functions_and_transforms():
    class MyLogit:
        p, draw, batch = 1., None, False
        def before_call(self, x): pass
        def __call__(self, x): return x*2
    assert 'no DALI formula' in colour_unsupported(LightingTfm(MyLogit()))
    assert 'not one of fastai' in colour_unsupported(aug_transforms()[0])      # Flip
    with pytest.raises(ValueError, match="cannot compile Flip into DALI: it is not one of fastai's lighting"):
        colour_batch(sample_images(), aug_transforms()[0])


def test_per_sample_draw_too_short():
    with pytest.raises(ValueError, match='got 2 values for batches of 3'):
        colour_batch(sample_images(), Hue(p=1., draw=[1.1, 0.9]))


def test_bad_batch_shape():
    with pytest.raises(ValueError, match=r'\[n, h, w, 3\]'):
        colour_batch(np.zeros((2, 3, 8, 8), np.float32), Hue())


# ---------------------------------------------------------------- the GPU backend

@needs_gpu("the GPU backend")
@pytest.mark.parametrize('name', list(FIXED))
def test_gpu_matches_fastai(name):
    ims = sample_images()
    tfm = FIXED[name]()
    ours, theirs = colour_batch(ims, tfm, device_id=0), fastai_batch(ims, tfm)
    assert np.abs(ours - theirs).max() <= 1e-5, f"{name}: max |DALI GPU - fastai| = {np.abs(ours - theirs).max():.2e}"


@needs_gpu("the GPU backend")
def test_gpu_random_draws():
    "fastai's own draws on the GPU backend: reproducible per seed, per sample, some samples left alone"
    ims = np.repeat(sample_images()[:1], 64, axis=0)
    lighting = aug_transforms(max_lighting=0.4, p_lighting=0.5)[-1]
    out = colour_batch(ims, lighting, device_id=0, seed=3)
    np.testing.assert_array_equal(out, colour_batch(ims, lighting, device_id=0, seed=3))
    unchanged = np.abs(out - ims).reshape(64, -1).max(1) <= 2e-7
    assert 2 <= unchanged.sum() <= 40, f"{unchanged.sum()} of 64 unchanged, expected about 16"
    assert len({float(np.abs(o - ims[0]).mean()) for o in out[~unchanged]}) == (~unchanged).sum()
    assert out.min() >= 0 and out.max() <= 1


def test_batch_true_through_the_node_one_change_per_batch():
    "A `batch=True` draw is tied to its batch: `colour_nodes` draws it a batch at a time, not several batches in one call"
    im = np.full((4, 1, 1, 3), [0.8, 0.3, 0.2], dtype=np.float32)
    outs = run(lambda x: colour_nodes(x, [Brightness(max_lighting=0.4, p=1., batch=True)]), images=im, batches=6)
    per_batch = [o[0][:, 0, 0, 0] for o in outs]
    assert all(np.allclose(b, b[0]) for b in per_batch), "samples of one batch differ with batch=True"
    assert len({round(float(b[0]), 6) for b in per_batch}) == 6, "batches share a batch=True change"
