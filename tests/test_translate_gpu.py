"""The translated graph on DALI's GPU backend: same pixels as the CPU backend with fixed draws, and random
aug_transforms() batches of the right shape and range. Run on the GPU machine: `python -m pytest -q tests/test_translate_gpu.py`."""
import tempfile
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from fastai.vision.augment import Resize, RandomResizedCrop, Rotate, Warp, Zoom, Flip, aug_transforms
from fastai.vision.data import imagenet_stats
from fastai.data.transforms import Normalize
from nvidia.dali import fn
from nvidia.dali.pipeline import Pipeline

from dali_fastai.translate import fastai_recipe
from dali_fastai.recipe import keyword_recipe

from helpers import gpu_marks

pytestmark = gpu_marks('the GPU backend')


def gradient(h, w):
    yy,xx = np.mgrid[:h, :w].astype(np.float64)
    return np.stack([255*xx/(w-1), 255*yy/(h-1), 127.5 + 100*np.sin(xx/w*3 + yy/h*2)], -1).round().astype(np.uint8)


@pytest.fixture(scope='module')
def files():
    with tempfile.TemporaryDirectory() as d:
        fs = []
        for i,(h,w) in enumerate([(48, 48), (64, 64), (56, 56), (40, 40)]):  # square: Resize's training window is the whole image
            Image.fromarray(gradient(h, w)).save(Path(d)/f'{i}.jpg', quality=98)
            fs.append(Path(d)/f'{i}.jpg')
        yield fs


def run(recipe, files, device_id, seed=0):
    pipe = Pipeline(batch_size=len(files), num_threads=2, device_id=device_id, seed=seed)
    with pipe:
        encoded,_ = fn.readers.file(files=[str(f) for f in files], labels=list(range(len(files))))
        pipe.set_outputs(recipe.build(encoded, device_id=device_id))
    pipe.build()
    (out,) = pipe.run()
    return np.array((out.as_cpu() if device_id is not None else out).as_array())


FIXED = [Rotate(p=1., draw=20), Zoom(p=1., draw=1.2, draw_x=0.3, draw_y=0.6), Warp(p=1., draw_x=0.1, draw_y=-0.1),
         Flip(p=1., draw=1), Normalize.from_stats(*imagenet_stats, cuda=False)]


@pytest.mark.parametrize('item,train', [(Resize(32), True), (Resize(32, method='pad'), True), (Resize(32, method='squish'), True),
                                        (RandomResizedCrop(32), False)], ids=['crop', 'pad', 'squish', 'rrc-valid'])
def test_gpu_matches_cpu_with_fixed_draws(files, item, train):
    "Deterministic windows and fixed draws: the GPU graph gives the CPU graph's pixels (JPEG decoders may differ a little)"
    r = fastai_recipe(item, FIXED, train=train)
    cpu,gpu = run(r, files, None),run(r, files, 0)
    diff = np.abs(cpu - gpu)*255*0.229  # back to levels of 255 (at most: the smallest std)
    # nvJPEG and libjpeg differ most at strong edges, and a whole-image decode then resize (rrc-valid) shows it most
    assert diff.max() <= 12 and diff.mean() < 1, (diff.max(), diff.mean())


def test_gpu_random_aug_transforms(files):
    r = fastai_recipe(RandomResizedCrop((24, 40), min_scale=0.35), aug_transforms() + [Normalize.from_stats(*imagenet_stats)],
                      train=True)
    out = run(r, files*8, 0, seed=3)
    assert out.shape == (32, 3, 24, 40) and np.isfinite(out).all()
    assert not np.allclose(out[0], out[4])  # the same file, two different draws


@pytest.mark.parametrize('train', [True, False])
def test_gpu_keyword_recipe(files, train):
    out = run(keyword_recipe(train, (24, 32), **(dict(warp_mode=None) if train else {})), files, 0)
    assert out.shape == (4, 3, 24, 32)
