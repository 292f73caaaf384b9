"""Where a session's `lr_find` and first fits spend their batches with `FastStep()` (its race) and `FastStep(graph=True)`:

    python tools/race_probe.py [--seeds 0 1] [--variants auto graph]

Each variant and seed in a fresh process, on the session bench's folder and learner (`sessionbench.session_run`'s):
`lr_find()`, then `fine_tune(1)` (one frozen epoch, one unfrozen). For each phase: its seconds, and the training batches'
host seconds in windows (from one batch's end to the next one's, GPU synced at each phase's ends), so that a race, a
capture or a slow start shows where it lands."""
import argparse, json, subprocess, sys, time
import torch
from fastai.callback.core import Callback
from fastai.callback.schedule import lr_find  # noqa: F401
from dali_fastai.faststep import FastStep
from dali_fastai.sessionbench import _task_data, _loaders, _quiet, race_verdicts
from dali_fastai.epoch import as_device

WINDOWS = ((0, 3), (3, 12), (12, 22), (22, 40), (40, 100))


class BatchClock(Callback):
    "The host's clock at each training batch's end, fit by fit"
    order = 100
    def __init__(self): self.fits = []
    def before_fit(self):
        if torch.cuda.is_available(): torch.cuda.synchronize()
        self.fits.append([time.perf_counter()])
    def after_batch(self):
        if self.training: self.fits[-1].append(time.perf_counter())
    def before_validate(self): self.fits[-1].append('valid')


def windows(marks:list)->str:
    "Mean milliseconds a batch in each of `WINDOWS`, training batches only"
    ts = [m for m in marks if m != 'valid']
    gaps = [b - a for a,b in zip(ts, ts[1:])]
    return '  '.join(f"{lo}-{min(hi, len(gaps))}: {1e3*sum(gaps[lo:hi])/len(gaps[lo:hi]):.1f}" for lo,hi in WINDOWS if gaps[lo:hi])


def one(variant:str, seed:int)->dict:
    t,src,db = _task_data('classification', None, 224)
    device = as_device(None)
    dls = _loaders('dali_fastai + FastStep()', db, src, 64, device, seed, None)
    clock = BatchClock()
    learn = t.learner(dls, [FastStep(graph={'auto': 'auto', 'graph': True, 'eager': False}[variant]), clock], metric=True, size=224)
    out = {}
    with _quiet(learn):
        for name,f in (('lr_find', lambda: learn.lr_find(show_plot=False)), ('fine_tune(1)', lambda: learn.fine_tune(1))):
            a = time.perf_counter(); f(); torch.cuda.synchronize() if torch.cuda.is_available() else None; out[name] = time.perf_counter() - a
    out['fits'] = [windows(m) for m in clock.fits]
    out['races'] = race_verdicts(learn)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--seeds', type=int, nargs='+', default=[0, 1])
    p.add_argument('--variants', nargs='+', default=['auto', 'graph'], choices=['auto', 'graph', 'eager'])
    p.add_argument('--one', nargs=2, default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one: return print('PROBE ' + json.dumps(one(a.one[0], int(a.one[1]))))
    _task_data('classification', None, 224)  # the folder, made once
    for seed in a.seeds:
        for v in a.variants:
            r = subprocess.run([sys.executable, __file__, '--one', v, str(seed)], capture_output=True, text=True)
            line = next((l for l in r.stdout.splitlines() if l.startswith('PROBE ')), None)
            if line is None: print(v, seed, 'failed:', r.stderr.strip().splitlines()[-3:]); continue
            res = json.loads(line[6:])
            print(f"{v:6} seed {seed}: lr_find {res['lr_find']:.2f} s, fine_tune(1) {res['fine_tune(1)']:.2f} s; races {res['races']}")
            for name,w in zip(('lr_find', 'fit 1 (frozen)', 'fit 2'), res['fits']): print(f"    {name:15} ms a batch, by batches: {w}")


if __name__ == '__main__': main()
