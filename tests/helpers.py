"""Shared test data: images whose colour encodes their index or their pixel coordinates, a Fashion-MNIST subset, a tiny
model, and the switch that makes GPU tests fail instead of skipping (`make gpu-test`). The `files` fixture is in
`conftest.py`.

Import explicitly (`from helpers import ...`): pytest puts `tests/` on `sys.path` (rootdir-relative import, no
`__init__.py`)."""
import importlib.util, os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn
from fastai.callback.core import Callback
from fastai.learner import Learner
from fastai.losses import CrossEntropyLossFlat

from dali_fastai.datasets import fashion_mnist, FASHION_MNIST_CLASSES
from dali_fastai.loader import DaliDataLoader, ImageItems
from dali_fastai.data import DaliDataLoaders

MAX_INDEX = 256  # `index_colour` encodes 0 .. 255
# The README's normalization (ImageNet's statistics), written out rather than imported: a wrong default in the package
# must not be mirrored by the tests' own decoding.
IMAGENET_MEAN,IMAGENET_STD = (0.485, 0.456, 0.406),(0.229, 0.224, 0.225)

# `make gpu-test` sets DALI_FASTAI_GPU_TESTS=1: GPU tests then run, and fail when no GPU is visible, instead of skipping
GPU_RUN = os.environ.get('DALI_FASTAI_GPU_TESTS') == '1'


def gpu_marks(what:str)->list:
    "Marks of a test that needs a GPU: `gpu` (what `make gpu-test` selects); skipped without one, unless in a GPU run"
    return [pytest.mark.gpu, pytest.mark.skipif(not GPU_RUN and not torch.cuda.is_available(),
                                                reason=f'{what}: needs a GPU (`make gpu-test` runs it on the GPU machine)')]


def needs_gpu(what:str):
    "Decorator: `gpu_marks(what)` on a test function"
    def mark(f):
        for m in gpu_marks(what): f = m(f)
        return f
    return mark


def flat(batches:list)->list: return [i for b in batches for i in b]


def index_colour(i:int)->tuple:
    "RGB of item `i`: 16 levels of red for `i % 16`, 16 of green for `i // 16`, in the middle of each level's band"
    if not 0 <= i < MAX_INDEX: raise ValueError(f"index {i} out of 0..{MAX_INDEX-1}")
    return (16*(i % 16) + 8, 16*(i // 16) + 8, 128)


def make_index_images(folder, n:int, side:int=12)->list:
    "Lossless PNGs `folder/000.png ...`, each one solid `index_colour(i)`: crops, resizes and flips keep the colour"
    folder = Path(folder); folder.mkdir(parents=True, exist_ok=True)
    files = []
    for i in range(n):
        f = folder/f'{i:03d}.png'
        Image.fromarray(np.full((side, side, 3), index_colour(i), dtype=np.uint8)).save(f)
        files.append(f)
    return files


def denorm(x:torch.Tensor, mean=IMAGENET_MEAN, std=IMAGENET_STD)->torch.Tensor:
    "Normalized NCHW batch → 0..255 floats"
    m,s = torch.tensor(mean).view(1, 3, 1, 1),torch.tensor(std).view(1, 3, 1, 1)
    return (x.float().cpu()*s + m)*255


def decode_index(x:torch.Tensor)->list:
    "Item indices of a normalized batch of `make_index_images` images, read back from their colour"
    p = denorm(x)
    r,g = p[:, 0].mean((1, 2)),p[:, 1].mean((1, 2))
    return ((r // 16) + 16*(g // 16)).long().tolist()


COORD_SCALE = 4  # `make_coordinate_image`: 4 levels of red (green) per pixel column (row), so up to 64 pixels a side


def make_coordinate_image(f, side:int=64)->Path:
    """A lossless PNG whose red and green are its pixel centre's x and y (`COORD_SCALE` levels a pixel), blue 200:
    resizes and bilinear warps keep such a linear image linear, so the map a loader applied can be read off its output"""
    if side*COORD_SCALE > 256: raise ValueError(f"side {side} too large: at most {256//COORD_SCALE}")
    yy,xx = np.mgrid[:side, :side]
    img = np.stack([COORD_SCALE*(xx + 0.5), COORD_SCALE*(yy + 0.5), np.full(xx.shape, 200.)], -1)
    Image.fromarray(img.astype(np.uint8)).save(f)
    return Path(f)


def source_maps(x:torch.Tensor, # normalized NCHW batch of `make_coordinate_image` images through a loader
                margin:float=0.25, # fit on the centre, leaving this share of each side (borders are padded, not linear)
               )->np.ndarray: # `[N, 2, 3]`: output pixel centre (u, v) -> source pixel coordinates (x, y)
    "The affine map each sample's pixels were read through, fitted by least squares to its red and green"
    p = denorm(x).numpy()
    n,_,h,w = p.shape
    vv,uu = np.mgrid[:h, :w] + 0.5
    keep = ((uu > margin*w) & (uu < (1 - margin)*w) & (vv > margin*h) & (vv < (1 - margin)*h)).ravel()
    a = np.stack([uu.ravel(), vv.ravel(), np.ones(h*w)], 1)[keep]
    src = p[:, :2].reshape(n, 2, -1)[..., keep]/COORD_SCALE  # [n, 2, pixels]
    sol = np.linalg.lstsq(a, src.transpose(2, 0, 1).reshape(len(a), -1), rcond=None)[0]  # [3, n*2]
    return sol.reshape(3, n, 2).transpose(1, 2, 0)


def index_items(files:list)->ImageItems:
    "Items labelled by their index (the file name's number), out of `MAX_INDEX` classes named '0', '1', ..."
    return ImageItems(files, [int(Path(f).stem) for f in files], [str(i) for i in range(MAX_INDEX)])


def index_loader(files:list, bs:int, size:int=8, **kwargs)->DaliDataLoader:
    "A CPU loader over `files` (from `make_index_images`) whose label is each item's index"
    return DaliDataLoader(index_items(files), bs=bs, size=size, device='cpu', **kwargs)


def epoch_items(dl)->list:
    "One epoch of `dl` as a list of batches, each a list of item indices; checks labels and pixels agree"
    res = []
    for x,y in dl:
        ids = y.tolist()
        assert decode_index(x) == ids, f"images {decode_index(x)} do not match their labels {ids}"
        res.append(ids)
    return res


def fmnist_path()->Path:
    "The embedded Fashion-MNIST folders (written once into the user's cache)"
    return fashion_mnist(progress=False)


def fmnist_subset(n_per_class:int=30, split:str='train')->tuple:
    "(files, labels): the first `n_per_class` images of every Fashion-MNIST class in `split`, in class order"
    root = fmnist_path()/split
    files,labels = [],[]
    for c in FASHION_MNIST_CLASSES:
        fs = sorted((root/c).glob('*.jpg'))[:n_per_class]
        files += fs; labels += [c]*len(fs)
    return files,labels


def tiny_model(c:int)->nn.Module:
    "A model for tests where the architecture is not the point: mean colour → `c` logits"
    return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, c))


class Items(Callback):
    "Record the items each training and validation phase sees"
    order = -5
    def before_fit(self): self.train_items,self.valid_items = [],[]
    def before_train(self): self.train_items.append([])
    def before_validate(self): self.valid_items.append([])
    def before_batch(self): (self.train_items if self.training else self.valid_items)[-1].extend(self.y.tolist())


class RaiseAt(Callback):
    "Raise `exc` after the `n`-th batch (1-based) of the first training (or validation) phase"
    order = 10
    def __init__(self, exc, n=2, in_train=True): self.exc,self.n,self.in_train,self.done = exc,n,in_train,False
    def after_batch(self):
        if self.done or self.training != self.in_train or self.iter + 1 != self.n: return
        self.done = True
        raise self.exc('raised by a test callback')


def load_tool(name):
    "Import `tools/<name>.py` by path (tools/ is a folder of scripts, not a package)"
    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location(f'tools_{name}', root/'tools'/f'{name}.py')
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


N_TRAIN,N_VALID,BS = 40,13,4  # `index_learner`: 10 train batches, 4 valid batches


def index_learner(files, tmp_path, drain_limit=4):
    "A tiny-model `Learner` over the first `N_TRAIN` index images (train) and the next `N_VALID` (valid), recording `Items`"
    train = DaliDataLoader(index_items(files[:N_TRAIN]), bs=BS, size=8, train=True, device='cpu', seed=0,
                           drain_limit=drain_limit)
    valid = DaliDataLoader(index_items(files[N_TRAIN:N_TRAIN + N_VALID]), bs=BS, size=8, device='cpu',
                           drain_limit=drain_limit)
    dls = DaliDataLoaders(train, valid, path=tmp_path, device='cpu')
    return Learner(dls, tiny_model(MAX_INDEX), loss_func=CrossEntropyLossFlat(), path=tmp_path, cbs=Items())


def assert_resume_replays(dl):
    "A copy of `dl` restored from its JSON `state_dict` after one batch yields the same next batch as `dl` (every tensor)"
    import json
    it = iter(dl); next(it)
    state = json.loads(json.dumps(dl.state_dict()))
    want = next(it)
    resumed = dl.new(); resumed.load_state_dict(state)
    got = next(iter(resumed))
    assert len(got) == len(want) and all(torch.equal(a, b) for a,b in zip(got, want))
