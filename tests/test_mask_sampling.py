"""Masks are sampled, never blended, and stay with their images: exact checks where `test_masks.py` measures agreement.

- Nearest-neighbour sampling: a mask of codes {0, 3, 7} keeps only those values through resizing, rotation, zoom and warp
  (linear sampling would invent 1, 2, 4, 5 and 6 on every border between them).
- Sampling at pixel centres: a one-pixel line stays one pixel, on its mirrored column or row, through flips and the
  dihedral turns (sampling half a pixel off moves or doubles it).
- Item flips: `FlipItem(p)` flips a share `p` of the items over many draws, with a coin for each item.
- Sharded validation in item order (DDP validation, `get_preds` under DDP): every rank's masks are its own images'."""
import os
import numpy as np
import pytest
import torch
from fastai.vision.all import (DataBlock, ImageBlock, MaskBlock, FuncSplitter, Resize, FlipItem, DihedralItem, Flip, Dihedral,
                               Rotate, Zoom, Warp, Normalize, imagenet_stats)
from PIL import Image

from dali_fastai.data import DaliDataLoaders
from helpers import make_index_images, decode_index

DEVICE = os.environ.get('DALI_FASTAI_TEST_DEVICE', 'cpu')


def mask_loaders(root, item_tfms, batch_tfms=None, codes=None, **kw):
    "Loaders over `root/images/*.png` and their masks `root/labels/*.png`; names starting with `valid` validate"
    dblock = DataBlock(blocks=(ImageBlock, MaskBlock(codes or [str(i) for i in range(8)])),
                       get_items=lambda p: sorted((p/'images').glob('*.png')), get_y=lambda o: root/'labels'/o.name,
                       splitter=FuncSplitter(lambda o: o.name.startswith('valid')), item_tfms=item_tfms, batch_tfms=batch_tfms)
    return DaliDataLoaders.from_dblock(dblock, root, **{'bs': 4, 'device': DEVICE, 'seed': 0, **kw})


def write_pairs(root, pairs:list)->object:
    "`(name, image HWC uint8, mask HW uint8)` as PNGs under `root/images` and `root/labels`"
    (root/'images').mkdir(parents=True); (root/'labels').mkdir(parents=True)
    for name,img,mask in pairs:
        Image.fromarray(img).save(root/'images'/f'{name}.png'); Image.fromarray(mask).save(root/'labels'/f'{name}.png')
    return root


def masks_of(dl, epochs:int=1)->list:
    "Every mask of `epochs` epochs of `dl`, as `[h, w]` NumPy arrays"
    return [m for _ in range(epochs) for _,y in dl for m in y.cpu().numpy()]


# ---- nearest-neighbour sampling: the codes stay in the set
CODES = (0, 3, 7)

@pytest.fixture(scope='module')
def patches(tmp_path_factory):
    "Masks of random 3-9 pixel patches of codes 0, 3 and 7 (no two neighbouring codes), 40x56 pixels, images coloured alike"
    pairs = []
    for i in range(12):
        rng = np.random.default_rng(i)
        mask = np.kron(rng.choice(CODES, (8, 8)), np.ones((5, 7), np.uint8)).astype(np.uint8)
        mask = np.roll(mask, rng.integers(0, 4, 2), (0, 1))
        pairs.append((f"{'valid' if i >= 8 else 'train'}_{i:02d}", np.repeat(mask[..., None]*30, 3, -1), mask))
    return write_pairs(tmp_path_factory.mktemp('patches'), pairs)


RESAMPLING = {  # every one resamples between pixel centres: a blend of 0 and 7 would be 1..6
    'Resize 23': ([Resize(23)], None),
    'Resize 50x70 squish': ([Resize((50, 70), method='squish')], None),
    'Rotate': ([Resize(32)], [Rotate(max_deg=40, p=1.)]),
    'Zoom': ([Resize(32)], [Zoom(min_zoom=1.1, max_zoom=1.6, p=1.)]),
    'Warp': ([Resize(32)], [Warp(magnitude=0.3, p=1.)]),
}

@pytest.mark.parametrize('name', list(RESAMPLING))
def test_masks_keep_their_codes(patches, name):
    item,batch = RESAMPLING[name]
    dls = mask_loaders(patches, item, batch)
    for dl in (dls.train, dls.valid):
        ms = masks_of(dl, 2 if dl is dls.train else 1)
        values = set(np.unique(np.stack(ms)).tolist())
        assert values <= set(CODES), f"{name}: values {sorted(values - set(CODES))} are no code: the mask was blended"
        assert values == set(CODES)


# ---- sampling at pixel centres: a one-pixel line stays one pixel
S = 16

def line_mask()->np.ndarray:
    "A 16x16 mask with a one-pixel vertical line of 1 (column 5) and a one-pixel horizontal line of 2 (row 3, left part)"
    m = np.zeros((S, S), np.uint8)
    m[:, 5] = 1; m[3, :4] = 2
    return m

def dihedral(m:np.ndarray)->list:
    "The 8 images of `m` under the square's symmetries"
    return [np.rot90(f, k) for f in (m, m[:, ::-1]) for k in range(4)]

@pytest.fixture(scope='module')
def lines(tmp_path_factory):
    m = line_mask()
    return write_pairs(tmp_path_factory.mktemp('lines'),
                       [(f"{'valid' if i >= 8 else 'train'}_{i:02d}", np.repeat(m[..., None]*100, 3, -1), m) for i in range(12)])

def test_validation_masks_are_the_files(lines):
    "No augmentation, the image's own size: every pixel as it is in the file"
    for m in masks_of(mask_loaders(lines, [Resize(S)]).valid): assert np.array_equal(m, line_mask())

def test_flipped_lines_stay_one_pixel(lines):
    "FlipItem and Flip at p=1: the line lands on the mirrored column, one pixel wide, every pixel exact"
    want = line_mask()[:, ::-1]
    for item,batch in (([Resize(S), FlipItem(p=1.)], None), ([Resize(S)], [Flip(p=1.)])):
        for m in masks_of(mask_loaders(lines, item, batch).train): assert np.array_equal(m, want), (item, batch, m)

def test_dihedral_turns_keep_lines_one_pixel(lines):
    "DihedralItem and Dihedral at p=1: each mask is exactly one of the 8 turns and flips of the file (rotations by 90 among them)"
    images = dihedral(line_mask())
    for item,batch in (([Resize(S), DihedralItem(p=1.)], None), ([Resize(S)], [Dihedral(p=1.)])):
        seen = set()
        for m in masks_of(mask_loaders(lines, item, batch).train, epochs=3):
            k = next((k for k,d in enumerate(images) if np.array_equal(m, d)), None)
            assert k is not None, f"{item} {batch}: not a turn or flip of the mask:\n{m}"
            seen.add(k)
        assert len(seen) >= 4, f"{item} {batch}: only {sorted(seen)} of the 8 drawn"


# ---- item flips: a coin for each item, of probability p
@pytest.fixture(scope='module')
def halves(tmp_path_factory):
    "64 images dark on the left half and bright on the right (masks alike): a flip swaps the halves"
    m = np.zeros((8, 8), np.uint8); m[:, 4:] = 1
    return write_pairs(tmp_path_factory.mktemp('halves'),
                       [(f"{'valid' if i >= 64 else 'train'}_{i:03d}", np.repeat(m[..., None]*200 + 20, 3, -1), m) for i in range(68)])

@pytest.mark.parametrize('p', [0.5, 0.2])
def test_item_flip_probability(halves, p):
    "Over 320 draws (5 epochs of 64 items) the share flipped is p within 5 standard deviations, and batches mix flips"
    dl = mask_loaders(halves, [Resize(8), FlipItem(p=p)], bs=16, val_bs=4).train
    flipped = [[bool(m[0, 0] == 1) for m in y.cpu().numpy()] for _ in range(5) for _,y in dl]
    n,share = sum(map(len, flipped)),np.mean([f for b in flipped for f in b])
    assert n == 320 and abs(share - p) <= 5*np.sqrt(p*(1 - p)/n), f"FlipItem(p={p}) flipped {share:.3f} of {n} items"
    assert sum(0 < sum(b) < len(b) for b in flipped) >= len(flipped) - 2, "one coin per item, not one per batch"


# ---- sharded validation in item order keeps masks with their images
N_TRAIN,N_VALID = 8, 7

@pytest.fixture(scope='module')
def identities(tmp_path_factory):
    "Images in their index's colour (`make_index_images`), each mask one value: the same index"
    root = tmp_path_factory.mktemp('identities')
    files = make_index_images(root/'src', N_TRAIN + N_VALID)
    pairs = [(f"{'valid' if i >= N_TRAIN else 'train'}_{i:02d}", np.asarray(Image.open(f)), np.full((12, 12), i, np.uint8))
             for i,f in enumerate(files)]
    return write_pairs(root, pairs)

@pytest.mark.parametrize('world', [2, 3])
def test_sharded_validation_keeps_masks_with_images(identities, world):
    "`dls.valid.new().shard(rank, world)` (DDP validation, `get_preds` under DDP): each rank's masks are its images'; together, every item once"
    dls = mask_loaders(identities, [Resize(8)], [Normalize.from_stats(*imagenet_stats)],
                       codes=[str(i) for i in range(N_TRAIN + N_VALID)], bs=2)
    seen = []
    for rank in range(world):
        dl = dls.valid.new(); dl.shard(rank, world)
        for x,y in dl:
            ids = decode_index(x)
            assert [int(m.min()) for m in y] == [int(m.max()) for m in y] == ids, f"rank {rank}: masks {y[:, 0, 0].tolist()} for images {ids}"
            seen += ids
    assert sorted(seen) == list(range(N_TRAIN, N_TRAIN + N_VALID))
