"""The first training and validation batch of four pipelines, on DALI's CPU backend with a fixed seed, saved to one .npz;
`--compare A.npz B.npz` says whether two such files are bit-identical. A refactor that must not change outputs runs it
before and after (issue 30):

    git stash; python tools/first_batches.py --out /tmp/before.npz; git stash pop
    python tools/first_batches.py --out /tmp/after.npz
    python tools/first_batches.py --compare /tmp/before.npz /tmp/after.npz

Pipelines: the default classification pipeline (`from_folder`), fastai's `aug_transforms()` (`from_dblock`), detection
(`from_coco` with `aug_transforms()`), segmentation (`from_label_func` with `aug_transforms()`), on the embedded data.
"""
import argparse, sys, tempfile
from pathlib import Path

import numpy as np


def _arrays(o, prefix:str, out:dict):
    "Flatten a batch (tensors, tuples of them) into `out` as numpy arrays named `prefix.i`"
    import torch
    if isinstance(o, (tuple, list)):
        for i,x in enumerate(o): _arrays(x, f'{prefix}.{i}', out)
    elif isinstance(o, torch.Tensor): out[prefix] = o.detach().cpu().numpy()


def _loaders(root:Path)->dict:
    "name → a function making that pipeline's `DaliDataLoaders` on the CPU, seed 0"
    from fastai.vision.all import (DataBlock, ImageBlock, CategoryBlock, GrandparentSplitter, get_image_files, parent_label,
                                   Resize, RandomResizedCrop, aug_transforms)
    from dali_fastai.all import DaliDataLoaders, fashion_mnist, fashion_scenes
    fm = fashion_mnist(root/'fm')
    sc = fashion_scenes(root/'scenes', n_train=24, n_valid=8, size=96, progress=False)
    kw = dict(bs=8, device='cpu', seed=0, num_threads=1)
    def seg():
        fnames = sorted((sc/'JPEGImages').glob('*.jpg'))
        return DaliDataLoaders.from_label_func(sc, fnames, lambda f: sc/'SegmentationClass'/f'{f.stem}.png', valid_pct=0.25,
                                               codes=(sc/'codes.txt').read_text().split(), item_tfms=Resize(64),
                                               batch_tfms=aug_transforms(), **kw)
    def aug():
        dblock = DataBlock(blocks=(ImageBlock, CategoryBlock), get_items=get_image_files, get_y=parent_label,
                           splitter=GrandparentSplitter(valid_name='valid'), item_tfms=RandomResizedCrop(32),
                           batch_tfms=aug_transforms())
        return DaliDataLoaders.from_dblock(dblock, fm, **kw)
    return dict(default=lambda: DaliDataLoaders.from_folder(fm, valid='valid', size=32, **kw),
                aug_transforms=aug,
                detection=lambda: DaliDataLoaders.from_coco(sc, images='JPEGImages', item_tfms=Resize(64),
                                                            batch_tfms=aug_transforms(), **kw),
                segmentation=seg)


def first_batches(root:Path)->dict:
    "Every pipeline's first training and validation batch, as numpy arrays by name"
    out = {}
    for name,make in _loaders(root).items():
        dls = make()
        for split,dl in (('train', dls.train), ('valid', dls.valid)): _arrays(next(iter(dl)), f'{name}.{split}', out)
        shapes = [f"{k[len(name)+1:]} {v.shape}" for k,v in out.items() if k.startswith(name + '.')]
        print(f"{name}: {', '.join(shapes)}", flush=True)
    return out


def compare(a:str, b:str)->bool:
    "Whether the two files hold the same names with bit-identical arrays; prints each difference"
    x,y = np.load(a),np.load(b)
    same = set(x.files) == set(y.files)
    if not same: print(f"names differ: only in {a}: {sorted(set(x.files)-set(y.files))}, only in {b}: {sorted(set(y.files)-set(x.files))}")
    for k in sorted(set(x.files) & set(y.files)):
        if x[k].dtype != y[k].dtype or x[k].shape != y[k].shape or x[k].tobytes() != y[k].tobytes():
            print(f"{k}: differs ({x[k].dtype}{x[k].shape} vs {y[k].dtype}{y[k].shape})"); same = False
    print(f"{len(x.files)} arrays: {'bit-identical' if same else 'NOT identical'}")
    return same


if __name__ == '__main__':
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--out', help='the .npz to write')
    p.add_argument('--data', help='folder for the embedded data (default: a temporary one)')
    p.add_argument('--compare', nargs=2, metavar=('A', 'B'), help='compare two .npz files instead')
    a = p.parse_args()
    if a.compare: sys.exit(0 if compare(*a.compare) else 1)
    if not a.out: p.error('--out or --compare')
    with tempfile.TemporaryDirectory() as d:
        np.savez(a.out, **first_batches(Path(a.data or d)))
    print(f"wrote {a.out}")
