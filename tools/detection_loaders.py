"""Detection loaders side by side: DALI's (`DaliDataLoaders.from_dblock`) and fastai's own (`dblock.dataloaders`) on the
same DataBlock (`ImageBlock, BBoxBlock, BBoxLblBlock`, `Resize` per item, `aug_transforms` per batch) over the embedded
scenes (`fashion_scenes`), loader-only images per second in one run. On the GPU machine:

    python3 tools/detection_loaders.py --device gpu

prints img/s of each and their ratio (the detection issue's target: DALI's at least 5x fastai's)."""
import argparse, os
from fastai.vision.all import DataBlock, ImageBlock, BBoxBlock, BBoxLblBlock, FuncSplitter, Resize, aug_transforms
from dali_fastai.annotations import read_coco
from dali_fastai.bench import side_by_side, loader_throughput
from dali_fastai.data import DaliDataLoaders
from dali_fastai.loader import as_device
from dali_fastai.scenes import fashion_scenes


def scenes_dblock(root, size:int)->DataBlock:
    "fastai's detection DataBlock over the scenes at `root`, `size` pixels out"
    ann = {r.file.name: (r.boxes.tolist(), r.labels) for s in ('train', 'valid')
           for r in read_coco(root/'annotations'/f'{s}.json', root/'JPEGImages')[0]}
    return DataBlock(blocks=(ImageBlock, BBoxBlock, BBoxLblBlock), get_items=lambda d: sorted(d.glob('*.jpg')),
                     get_y=[lambda o: ann[o.name][0], lambda o: ann[o.name][1]], n_inp=1,
                     splitter=FuncSplitter(lambda o: o.name.startswith('valid')),
                     item_tfms=Resize(int(size*1.25)), batch_tfms=aug_transforms(size=size))


def measure(root, size:int=128, bs:int=64, device=None, n_batches:int=20, warmup:int=3, passes:int=3,
            workers:int|None=None)->dict: # name: img/s
    "Loader-only img/s of DALI's detection loader and fastai's, on the same DataBlock"
    device = as_device(device)
    dblock = scenes_dblock(root, size)
    ours = DaliDataLoaders.from_dblock(dblock, root/'JPEGImages', bs=bs, device=device, seed=0)
    res = side_by_side({'dali_fastai detection train': ours.train}, device, n_batches, warmup, passes)
    ours.train.close()
    theirs = dblock.dataloaders(root/'JPEGImages', bs=bs, device=device,
                                num_workers=os.cpu_count() if workers is None else workers)
    res['fastai detection train'] = loader_throughput(theirs.train, device, n_batches, warmup, passes)
    return res


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--size', type=int, default=128); p.add_argument('--bs', type=int, default=64)
    p.add_argument('--device', choices=['cpu', 'gpu'], default=None)
    p.add_argument('--batches', type=int, default=20); p.add_argument('--warmup', type=int, default=3)
    p.add_argument('--passes', type=int, default=3); p.add_argument('--workers', type=int, default=None)
    p.add_argument('--n-train', type=int, default=400)
    a = p.parse_args(argv)
    root = fashion_scenes(n_train=a.n_train, progress=False)
    res = measure(root, a.size, a.bs, a.device, a.batches, a.warmup, a.passes, a.workers)
    for k,v in res.items(): print(f"{k:<30}{v:>10,.0f} img/s")
    print(f"dali_fastai / fastai: {res['dali_fastai detection train']/res['fastai detection train']:.2f}x")
    return res


if __name__ == '__main__': main()
