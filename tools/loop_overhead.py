"""The host time fastai's training loop adds to a step, whatever the model: a tiny model on the CPU (its compute is a few
microseconds), trained by a plain PyTorch loop, by fastai's `Learner` (with and without its progress bar), and by
fastai with `FastStep()`, in turn, twice; then, with `--profile`, where fastai + FastStep's per-step time goes.

    python tools/loop_overhead.py [--batches 400] [--profile]

On a small-batch GPU step (ResNet-18 at fastai's bs 64) the GPU waits for the host, so this per-step host time is
what keeps `FastStep()` (no graph) under the plain loop: it lives in fastai's `Learner` (its events dispatched to every
callback, the schedule, the Recorder, the progress bar), not in the step FastStep replaces. `FastStep(graph=True)`
takes the model's kernel launches off the host instead."""
import argparse, contextlib, cProfile, io, pstats, time, warnings

import torch
from torch import nn
from fastai.callback.progress import ProgressCallback
from fastai.callback.schedule import fit_one_cycle  # noqa: F401 (adds Learner.fit_one_cycle)
from fastai.data.core import DataLoaders
from fastai.learner import Learner
from fastai.losses import CrossEntropyLossFlat
from fastai.metrics import accuracy

from dali_fastai.faststep import FastStep


class Batches:
    "The same small batch `n` times an epoch, as a fastai loader would hand it over"
    def __init__(self, n:int, bs:int=8):
        self.n,self.bs,self.device = n,bs,torch.device('cpu')
        self.x,self.y = torch.randn(bs, 16),torch.randint(0, 4, (bs,))
    def __iter__(self): return ((self.x, self.y) for _ in range(self.n))
    def __len__(self): return self.n
    def to(self, device): return self


def tiny(): return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def plain_us(n:int)->float:
    "Microseconds a step of a plain loop: forward, loss, backward, fused AdamW, zero_grad"
    m = tiny(); opt = torch.optim.AdamW(m.parameters(), fused=True); lf = nn.CrossEntropyLoss()
    start = time.perf_counter()
    for x,y in Batches(n):
        lf(m(x), y).backward(); opt.step(); opt.zero_grad(set_to_none=True)
    return (time.perf_counter() - start)/n*1e6


def learner(n:int, cbs=(), bar:bool=True)->Learner:
    learn = Learner(DataLoaders(Batches(n), Batches(2), device=None), tiny(), loss_func=CrossEntropyLossFlat(),
                    metrics=accuracy, cbs=list(cbs))
    if not bar: learn.remove_cb(ProgressCallback)
    return learn


def fastai_us(n:int, cbs=(), bar:bool=True)->float:
    "Microseconds a step of `fit_one_cycle` (one epoch of `n` batches; the 2-batch validation counted in)"
    learn = learner(n, cbs, bar)
    with contextlib.redirect_stdout(io.StringIO()):  # the progress bar still runs; its text is not shown
        start = time.perf_counter()
        learn.fit_one_cycle(1)
    return (time.perf_counter() - start)/n*1e6


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--batches', type=int, default=400); p.add_argument('--profile', action='store_true')
    a = p.parse_args()
    warnings.filterwarnings('ignore'); torch.set_num_threads(1)
    rows = {'plain PyTorch loop': [], 'fastai': [], 'fastai, no progress bar': [], 'fastai + FastStep()': [],
            'fastai + FastStep(), no progress bar': []}
    for _ in range(2):
        rows['plain PyTorch loop'].append(plain_us(a.batches))
        rows['fastai'].append(fastai_us(a.batches))
        rows['fastai, no progress bar'].append(fastai_us(a.batches, bar=False))
        rows['fastai + FastStep()'].append(fastai_us(a.batches, [FastStep()]))
        rows['fastai + FastStep(), no progress bar'].append(fastai_us(a.batches, [FastStep()], bar=False))
    print(f"\nhost microseconds a training step, a tiny model on the CPU ({a.batches} batches, best of 2):")
    for k,v in rows.items(): print(f"  {k:<40}{min(v):8.0f}")
    if a.profile:
        learn = learner(a.batches, [FastStep()])
        with contextlib.redirect_stdout(io.StringIO()):
            pr = cProfile.Profile(); pr.enable(); learn.fit_one_cycle(1); pr.disable()
        pstats.Stats(pr).sort_stats('tottime').print_stats(15)


if __name__ == '__main__': main()
