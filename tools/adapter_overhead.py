"""The host time `DaliDataLoader` adds to DALI's `next()`, and the garbage it leaves in reference cycles, on DALI's CPU
backend (no GPU needed):

    python tools/adapter_overhead.py [--n 20000] [--bs 64] [--size 16]

1. replay: the loader's DALI iterator is replaced by one that replays batches DALI made, so only the loader's own
   Python work per batch is timed (epochs of `len(dl)` batches, as `dali-fastai bench` iterates them), against
   replaying the same batches bare. Labelled (single-label classes) and unlabelled.
2. cycles: objects of each batch left in reference cycles, which only the garbage collector frees (the batch's images
   among them: on the GPU, DALI's own output buffer), and the collections 2000 batches trigger.
3. DALI: CPU microseconds the calling thread spends in a `next()` of the loader and of its bare DALI iterator
   (`time.thread_time`: its own work, DALI's iterator's included, not its wait for DALI's threads), passes in turn.

Issue 28 item 20 (the adapter's share of the bare iterator on the H100) was found with it: the per-batch path called
fastai's `after_batch` (only the no-op `DaliNormalize`) and typed targets through `TensorBase.__torch_function__`."""
import argparse, gc, statistics, tempfile, time
from pathlib import Path
import numpy as np
from PIL import Image

from dali_fastai.loader import DaliDataLoader, ImageItems


def images(folder:Path, n:int=512, side:int=16)->list:
    "`n` small PNGs, each one colour"
    folder.mkdir(parents=True, exist_ok=True)
    res = []
    for i in range(n):
        f = folder/f'{i:04d}.png'
        Image.fromarray(np.full((side, side, 3), (i % 256, i // 256, 128), dtype=np.uint8)).save(f)
        res.append(f)
    return res


class Replay:
    "Stands for DALI's iterator: `batches` it made, over and over, `n` a DALI epoch, then `StopIteration`"
    def __init__(self, batches:list, n:int): self.batches,self.n,self.i = batches,n,0
    def __iter__(self): return self
    def __next__(self):
        if self.i == self.n: self.i = 0; raise StopIteration
        self.i += 1
        return self.batches[self.i % len(self.batches)]


def loader(files:list, labelled:bool=True, bs:int=64, size:int=16)->DaliDataLoader:
    "A training loader on DALI's CPU backend, labelled by 10 classes or unlabelled"
    items = ImageItems(files, [i % 10 for i in range(len(files))] if labelled else None, [str(c) for c in range(10)])
    return DaliDataLoader(items, bs=bs, size=size, train=True, device='cpu', seed=0, num_threads=1)


def replayed(dl:DaliDataLoader, n_batches:int=4)->Replay:
    "Make `dl` read a replay of `n_batches` of its DALI batches from now on; the replay, for the bare side"
    it = dl._iterator()
    rep = Replay([next(it) for _ in range(n_batches)], len(dl))
    dl._source.it = rep  # the key stays: `_iterator()` returns the replay
    return Replay(rep.batches, len(dl))


def endless(make):
    "Batches of `make()`, epoch after epoch"
    while True: yield from make()


def per_batch(it, n:int)->float:
    "Seconds a `next(it)`, over `n` of them"
    t = time.perf_counter()
    for _ in range(n): next(it)
    return (time.perf_counter() - t) / n


def replay_us(dl:DaliDataLoader, n:int=20000, passes:int=7)->tuple:
    "Median microseconds a batch of the loader and of the bare replay, over `passes` passes in turn"
    bare = replayed(dl)
    a,b = endless(lambda: dl),endless(lambda: bare)
    ra,rb = [],[]
    for _ in range(passes): ra.append(per_batch(a, n // passes)); rb.append(per_batch(b, n // passes))
    return 1e6*statistics.median(ra),1e6*statistics.median(rb)


def cycles(dl:DaliDataLoader, n:int=2000)->tuple:
    "(objects a batch leaves in reference cycles, collections of generations 0, 1, 2 over `n` batches)"
    it = endless(lambda: dl)
    for _ in range(10): next(it)
    gc.collect(); gc.disable()
    try:
        for _ in range(n): next(it)
        left = gc.collect()
    finally: gc.enable()
    before = [s['collections'] for s in gc.get_stats()]
    for _ in range(n): next(it)
    return left / n,[s['collections'] - c for s,c in zip(gc.get_stats(), before)]


def dali_us(dl:DaliDataLoader, n:int=2000, passes:int=4)->tuple:
    "Mean CPU microseconds the calling thread spends in a `next()` of the loader and of its bare DALI iterator (a copy's), passes in turn: its own work, not its wait for DALI's threads"
    bare = dl.new()._iterator()
    its,times = (endless(lambda: dl),endless(lambda: bare)),([], [])
    for it in its:
        for _ in range(20): next(it)
    for _ in range(passes):
        for it,ts in zip(its, times):
            t = time.thread_time()
            for _ in range(n // passes): next(it)
            ts.append((time.thread_time() - t) / (n // passes))
    return tuple(1e6*statistics.median(ts) for ts in times)

if __name__ == '__main__':
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--n', type=int, default=20000, help="batches timed in the replay")
    p.add_argument('--bs', type=int, default=64)
    p.add_argument('--size', type=int, default=16)
    a = p.parse_args()
    files = images(Path(tempfile.mkdtemp())/'images')
    for labelled in (True, False):
        what = 'labelled' if labelled else 'unlabelled'
        dl = loader(files, labelled, a.bs, a.size)
        ours,bare = replay_us(dl, a.n)
        left,gcs = cycles(dl)
        print(f"replay, {what:10}: loader {ours:6.1f} us a batch, bare {bare:4.1f} us ({len(dl)} batches an epoch); "
              f"{left:.1f} objects a batch in reference cycles, collections (gen 0, 1, 2) over 2000 batches {gcs}", flush=True)
    ours,bare = dali_us(loader(files, True, a.bs, a.size))
    print(f"DALI CPU backend, labelled: the calling thread's CPU time in next(): loader {ours:6.1f} us, bare DALI iterator {bare:6.1f} us")
