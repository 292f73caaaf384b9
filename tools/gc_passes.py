"""Python's collector during a short detection fit: each epoch's seconds and the collections in it, by generation, with
their seconds, for `FastStep(graph=True)` with and without `freeze_gc`.

    python tools/gc_passes.py [detection|retinanet] [--epochs 10]

A full (generation 2) pass scans every object the collector tracks, ~0.58 M after torch, fastai and DALI are imported and
a learner is made. Read on an H200 (2026-11-26, FCOS at 128 px, bs 64, 10 epochs): without the freeze epoch 7 took 0.53 s
where the others took 0.20-0.30, with a full pass of 296 ms in it (0.25-0.59 s in the day's other runs); with it
(`GCFreeze`) the two full passes took 3 and 5 ms. GPU only.
"""
import argparse, collections, gc, time, warnings


def passes(task:str='detection', epochs:int=10):
    from fastai.callback.core import Callback
    from fastai.torch_core import set_seed
    from dali_fastai.stepbench import _task_data
    from dali_fastai.data import DaliDataLoaders
    from dali_fastai.measure import STEADY_PACE
    from dali_fastai.faststep import FastStep
    spent,counts,start = collections.defaultdict(float),collections.Counter(),{}
    def timed(phase, info):
        if phase == 'start': start['t'] = time.perf_counter()
        else: spent[info['generation']] += time.perf_counter() - start['t']; counts[info['generation']] += 1
    class Epochs(Callback):
        order = 99
        def before_epoch(self): self.t = time.perf_counter(); spent.clear(); counts.clear()
        def after_epoch(self):
            print(f"  epoch {self.epoch}: {time.perf_counter() - self.t:.2f} s; collections " +
                  ', '.join(f"gen{g} x{counts[g]} {1e3*spent[g]:.0f} ms" for g in sorted(counts)), flush=True)
    gc.callbacks.append(timed)
    t,src,db = _task_data(task, None, None)
    for freeze in (True, False):
        set_seed(0)
        dls = DaliDataLoaders.from_dblock(db, src, bs=64, device='cuda', seed=0, **STEADY_PACE)
        learn = t.learner(dls, [FastStep(graph=True, freeze_gc=freeze), Epochs()], metric=True, size=t.size)
        print(f"{task}, FastStep(graph=True, freeze_gc={freeze}): {len(gc.get_objects())} objects tracked", flush=True)
        with learn.no_bar(), learn.no_logging(): learn.fit_one_cycle(epochs, t.lr)
        del learn, dls; gc.collect()


if __name__ == '__main__':
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('task', nargs='?', default='detection'); ap.add_argument('--epochs', type=int, default=10)
    a = ap.parse_args()
    warnings.filterwarnings('ignore')
    passes(a.task, a.epochs)
