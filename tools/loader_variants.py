"""Where the compiled `aug_transforms()` loader spends its time: loader-only throughput of its parts, side by side in one run.

Each row is `DaliDataLoaders.from_folder(..., item_tfms=RandomResizedCrop(size), batch_tfms=[*aug_transforms(**kw), Normalize])`
with one part of `aug_transforms` left on (or all, or none), beside the default keyword pipeline; `bench.side_by_side`
times them side by side (one pass of each in turn; median of passes, warm-up excluded). On the GPU machine:

    python3 tools/loader_variants.py --device gpu

prints img/s and the ratio to the default pipeline for: default keywords, RandomResizedCrop only, flip+rotate, zoom,
warp, lighting, no lighting, aug_transforms(); and the host's time per batch for drawing `aug_transforms()`' parameters
(`HostDraws.draw`, which runs in the loader's thread)."""
import argparse, gc, statistics, time
from fastai.data.transforms import Normalize
from fastai.vision.augment import RandomResizedCrop, aug_transforms
from fastai.vision.core import imagenet_stats
from dali_fastai.measure import bench_images, side_by_side
from dali_fastai.colour import lighting_draws
from dali_fastai.draws import HostDraws
from dali_fastai.data import DaliDataLoaders
from dali_fastai.loader import as_device
from dali_fastai.translate import fastai_recipe

OFF = dict(do_flip=False, max_rotate=0., max_zoom=1., max_warp=0., max_lighting=0.)
VARIANTS = {  # name: `aug_transforms` keywords (None: the default keyword pipeline; OFF: no batch augmentation at all)
    'default keywords': None,
    'RandomResizedCrop only': OFF,
    'flip + rotate': {**OFF, 'do_flip': True, 'max_rotate': 10.},
    'zoom': {**OFF, 'max_zoom': 1.1},
    'warp': {**OFF, 'max_warp': 0.2},
    'lighting': {**OFF, 'max_lighting': 0.2},
    'no lighting': dict(max_lighting=0.),
    'aug_transforms()': {},
}

def variant_dls(path, kw:dict|None, size:int, bs:int, device, val_bs:int)->DaliDataLoaders:
    "The loaders of one variant"
    tfms = {} if kw is None else dict(item_tfms=RandomResizedCrop(size), batch_tfms=[*aug_transforms(**kw), Normalize.from_stats(*imagenet_stats)])
    return DaliDataLoaders.from_folder(path, bs=bs, val_bs=val_bs, size=size, device=device, seed=0, check_files=False, **tfms)

def measure(path, size:int=224, bs:int=256, device=None, n_batches:int=30, warmup:int=5, passes:int=3,
            variants:dict=VARIANTS)->dict: # name: img/s
    "Loader-only img/s of each variant's training loader, their passes taken in turn (`bench.side_by_side`)"
    device = as_device(device)
    # only the training loaders are timed: the validation ones get batches of 1, which any split fills
    dls = {name: variant_dls(path, kw, size, bs, device, val_bs=1) for name,kw in variants.items()}
    res = side_by_side({name: d.train for name,d in dls.items()}, device, n_batches, warmup, passes)
    for d in dls.values(): d.train.close(); d.valid.close()
    del dls; gc.collect()
    return res

def host_draw_ms(size:int=224, bs:int=256, n:int=50)->float:
    "Median milliseconds `HostDraws.draw` takes for one batch of `aug_transforms()`' matrices and lighting terms"
    r = fastai_recipe(RandomResizedCrop(size), aug_transforms(), train=True)
    draws = HostDraws(seed=0)
    draws.add(r.pixel_maps)
    for t in r.colour: draws.add(lighting_draws(t, bs))
    times = []
    for i in range(n):
        start = time.perf_counter()
        draws.draw(bs, i)
        times.append(time.perf_counter() - start)
    return 1e3*statistics.median(times[len(times)//5:])  # the first calls warm torch and fastai up

def format_table(res:dict)->str:
    "img/s and the ratio to the default keyword pipeline"
    base = res.get('default keywords')
    rows = [f"{'variant':<26}{'img/s':>10}{'vs default':>12}"]
    rows += [f"{n:<26}{r:>10,.0f}{(f'{r/base:.2f}x' if base else ''):>12}" for n,r in res.items()]
    return '\n'.join(rows)

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('path', nargs='?', help="ImageNet-style folder; default: `bench_images(n_per_class)`")
    p.add_argument('--size', type=int, default=224); p.add_argument('--bs', type=int, default=256)
    p.add_argument('--device', choices=['cpu', 'gpu'], default=None)
    p.add_argument('--batches', type=int, default=30); p.add_argument('--warmup', type=int, default=5)
    p.add_argument('--passes', type=int, default=3); p.add_argument('--n-per-class', type=int, default=100)
    a = p.parse_args(argv)
    path = a.path or bench_images(n_per_class=a.n_per_class)
    res = measure(path, a.size, a.bs, a.device, a.batches, a.warmup, a.passes)
    print(format_table(res))
    print(f"host draws of aug_transforms(), bs {a.bs}: {host_draw_ms(a.size, a.bs):.2f} ms per batch")
    return res

if __name__ == '__main__': main()
