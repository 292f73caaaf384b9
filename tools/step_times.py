"""Where inside `Learner.fit` does a DaliDataLoader-fed ResNet-18 lose its time? On the GPU machine:

    python tools/step_times.py [--n-per-class 500] [--kw num_threads=4] [--versus priority_stream=0]
                               [--lever fold threaded take_ahead] [--arch resnet50] [--bar] [--opt torch] [--no-valid]
                               [--burn 8]

1. The host time between one training batch and the next, through `Learner.fit`, fed by a synthetic batch kept on the
   GPU and by `DaliDataLoaders.from_folder(bench_images(...))`, taken in turn twice: the median step inside an epoch,
   and the step that starts an epoch (which includes the validation pass before it), and the median and longest time
   from one training batch's end to the next one's start inside an epoch (the loader's `next()` and fastai's
   bookkeeping: long when the host waits for the loader). Epochs 2-4 of 4.
2. Which PyTorch operations synchronize the device during a DALI-fed fit (`torch.cuda.set_sync_debug_mode('warn')`),
   grouped by the Python stack that called them.

`--burn N`: instead, is the host the bottleneck? The synthetic rows of 1., the same at bs 32 (a step the host, not the
GPU, bounds: fastai's Python a batch), and a plain PyTorch loop on the synthetic batch (`handover_probe.plain_loop`),
each with the CPU left alone and with N cores kept busy by another process decoding JPEGs on DALI's CPU backend (no
GPU, no shared GIL): if `Learner.fit` slows under that load and the plain loop does not, fastai's per-batch Python is
starved by the loader's CPU threads, not the GPU by its kernels.

Each row of 1. also reads CUDA events recorded at the same two points: where the GPU's stream was between one training
batch and the next (the GPU idles there while the host fetches the next batch, since fastai's `Recorder` reads every
training batch's loss to the CPU, a synchronization) and how long the GPU took for a batch.

`--versus name=value ...`: 1. with a third row, `DaliDataLoader` with these settings too, taken in turn with the others
(e.g. `priority_stream=0`: the training step on the caller's stream instead of a high-priority one).

`--lever fold threaded take_ahead`: 1. with a row for each lever of `tools/levers.py`, taken in turn with the others
(the resize folded into the warp; the loader's batches made by a thread of their own; the next batch taken by a
callback while the GPU still runs the step).

`--bar`: 1. with fastai's progress bar, as users train (`ProgressCallback` reads the smoothed loss with `.item()` every
batch: the host waits for the GPU, then fetches the next batch while the GPU idles).

`--no-valid`: 1. with every validation pass skipped (as `dali-fastai bench` times training): an epoch's first step is
then the epoch boundary alone.

`--opt torch`: every `Learner` trains with PyTorch's fused AdamW (`OptimWrapper`) instead of fastai's `Adam`, which
runs a few PyTorch operations a parameter in Python: the host's share of a step, as a user can change it.

The numbers of 2026-11-24 are in nbs/images/step_wait_h100.txt, step_times_h200.txt, step_priority_h100.txt and
step_levers_h100.txt, and the bench notebook's "The step no longer waits", "Where the rest goes" and "Third round"."""
import argparse, collections, contextlib, functools, statistics, subprocess, sys, threading, time, traceback, warnings
from pathlib import Path
import torch
from fastai.callback.core import Callback, CancelValidException
from fastai.data.core import DataLoaders
from fastai.optimizer import OptimWrapper

from dali_fastai.measure import STEADY_PACE, bench_images, SyntheticLoader, throughput_learner
from dali_fastai.data import DaliDataLoaders
from dali_fastai.pipeline import valid_pipeline

sys.path.insert(0, str(Path(__file__).parent))  # tools/ is a folder of scripts
from levers import LEVERS


class Stamps(Callback):
    "The host clock at the start and at the end of every training batch, with its epoch and index"
    order = 100
    def before_fit(self): self.t,self.ends = [],[]
    def stamp(self): return time.perf_counter()
    def before_batch(self):
        if self.training: self.t.append((self.epoch, self.iter, self.stamp()))
    def after_batch(self):
        if self.training: self.ends.append((self.epoch, self.iter, self.stamp()))


class GpuStamps(Stamps):
    "A CUDA event at the start and at the end of every training batch: where the GPU's stream was when the host got there"
    order = 101
    def stamp(self):
        e = torch.cuda.Event(enable_timing=True); e.record()
        return e


def host_ms(a:float, b:float)->float: return 1e3*(b - a)
def gpu_ms(a:torch.cuda.Event, b:torch.cuda.Event)->float: return a.elapsed_time(b)


def fetch_gaps(stamps:list, ends:list, skip:int, ms=host_ms)->list:
    "Milliseconds from the end of one training batch to the start of the next inside an epoch (the loader's `next()`), after `skip`"
    starts = {(e, i): t for e,i,t in stamps[skip:]}
    return [ms(t, starts[(e, i+1)]) for e,i,t in ends[skip:] if (e, i+1) in starts]


def batch_times(stamps:list, ends:list, skip:int, ms=host_ms)->list:
    "Milliseconds from the start of each training batch to its end, after `skip`"
    starts = {(e, i): t for e,i,t in stamps[skip:]}
    return [ms(starts[(e, i)], t) for e,i,t in ends[skip:] if (e, i) in starts]


def step_gaps(stamps:list, skip:int)->tuple:
    "Milliseconds from one training batch to the next after the first `skip` batches: (inside an epoch, into an epoch's first batch)"
    t = stamps[skip:]
    gaps = [(b[1], 1e3*(b[2] - a[2])) for a,b in zip(t, t[1:])]
    return [g for i,g in gaps if i > 0],[g for i,g in gaps if i == 0]


OPTS = {'fastai': None,  # the Learner's default, fastai's Adam
        'torch': functools.partial(OptimWrapper, opt=torch.optim.AdamW, fused=True)}

class NoValidation(Callback):
    "Skip every validation pass, as the bench's `Throughput` does: an epoch's first step is then the epoch boundary alone"
    def before_validate(self): raise CancelValidException()


def step_times(dls, bs:int, epochs:int=4, opt:str='fastai', bar:bool=False, valid:bool=True, cbs:list=(),
               arch:str='resnet18')->str:
    "Median host milliseconds of a step inside an epoch and of an epoch's first step, after the first epoch"
    learn = throughput_learner(dls, arch, c=10, cbs=[Stamps(), GpuStamps(), *cbs] + ([] if valid else [NoValidation()]))
    if OPTS[opt]: learn.opt_func = OPTS[opt]
    with contextlib.nullcontext() if bar else learn.no_bar(), learn.no_logging(): learn.fit(epochs)
    torch.cuda.synchronize()
    n,host,gpu = len(dls.train),learn.stamps,learn.gpu_stamps
    inside,first = step_gaps(host.t, n)
    fetch = fetch_gaps(host.t, host.ends, n)
    gpu_fetch,gpu_batch = fetch_gaps(gpu.t, gpu.ends, n, gpu_ms),batch_times(gpu.t, gpu.ends, n, gpu_ms)
    return (f"step median {statistics.median(inside):.1f} ms ({bs*1e3/statistics.median(inside):,.0f} img/s), "
            f"an epoch's first step {statistics.median(first):.0f} ms, between batches (next()) median "
            f"{statistics.median(fetch):.2f} ms, max {max(fetch):.2f} ms\n{'':18}on the GPU's stream: between batches median "
            f"{statistics.median(gpu_fetch):.2f} ms, a batch median {statistics.median(gpu_batch):.1f} ms")


def sync_sites(dls, n:int=6)->str:
    "The Python stacks of the PyTorch operations that synchronized the device in a two-epoch fit, most frequent first"
    sites = collections.Counter()
    def record(message, category, filename, lineno, file=None, line=None):
        if 'synchroniz' in str(message): sites[''.join(traceback.format_stack(limit=7)[:-2])] += 1
    learn = throughput_learner(dls, 'resnet18', c=10)
    shown = warnings.showwarning
    warnings.showwarning = record
    try:
        with warnings.catch_warnings():
            warnings.simplefilter('always'); torch.cuda.set_sync_debug_mode('warn')
            with learn.no_bar(), learn.no_logging(): learn.fit(2)
    finally: torch.cuda.set_sync_debug_mode(0); warnings.showwarning = shown
    return '\n'.join(f"--- {k} syncs at\n{s}" for s,k in sites.most_common(n))


def burn(files:list, threads:int):
    "Decode `files` on DALI's CPU backend with `threads` threads until killed, printing a line every 10 batches"
    pipe = valid_pipeline(files, [0]*len(files), bs=32, size=224, device_id=None, num_threads=threads)
    pipe.build()
    for k in range(1, sys.maxsize):
        pipe.run()
        if k % 10 == 0: print(f"burner: {k} batches", flush=True)


@contextlib.contextmanager
def busy_cores(folder, threads:int):
    "Another process keeps `threads` cores busy decoding the JPEGs under `folder` (`burn`) while the block runs"
    proc = subprocess.Popen([sys.executable, __file__, '--burner', str(folder), '--burn', str(threads)],
                            stdout=subprocess.PIPE, text=True)
    try:
        if not proc.stdout.readline().startswith('burner:'): raise RuntimeError(f"the burner process stopped: exit code {proc.wait()}")
        proc.lines = []  # read on: a full pipe would stop the burner
        threading.Thread(target=lambda: proc.lines.extend(proc.stdout), daemon=True).start()
        yield proc
    finally: proc.kill(); proc.wait()


if __name__ == '__main__':
    import fastai.callback.progress  # noqa: F401 (Learner.no_bar)
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--arch', default='resnet18', help="1.: the torchvision model trained (default: resnet18)")
    p.add_argument('--n-per-class', type=int, default=500, help="bench_images' images a class (default: 500)")
    p.add_argument('--kw', nargs='*', default=[], help="name=value for DaliDataLoaders.from_folder")
    p.add_argument('--versus', nargs='*', default=[], help="1. also with these name=value settings, in turn with the others")
    p.add_argument('--lever', nargs='*', default=[], choices=list(LEVERS),
                   help="1. also with these levers of tools/levers.py, in turn with the others")
    p.add_argument('--burn', type=int, default=0, help="instead: synthetic training with this many cores busy decoding elsewhere, against without")
    p.add_argument('--opt', choices=list(OPTS), default='fastai', help="the Learners' optimizer: fastai's Adam, or PyTorch's fused AdamW")
    p.add_argument('--bar', action='store_true', help="fit with fastai's progress bar, as users do (its loss comment reads the loss every batch)")
    p.add_argument('--no-valid', action='store_true', help="1. without validation passes: an epoch's first step is the epoch boundary alone")
    p.add_argument('--burner', default=None, help=argparse.SUPPRESS)  # the busy process itself: decode this folder's JPEGs
    a = p.parse_args()
    if a.burner: burn(sorted(str(f) for f in Path(a.burner).rglob('*.jpg')), a.burn); raise SystemExit
    settings = lambda kws: {k: (float(v) if '.' in v else int(v)) for k,v in (x.split('=') for x in kws)}
    kw,versus = settings(a.kw),settings(a.versus)
    make = lambda **more: DaliDataLoaders.from_folder(bench_images(n_per_class=a.n_per_class), bs=256, size=224, device='gpu', seed=0, **{**STEADY_PACE, **kw, **more})
    dls = make()
    synth = SyntheticLoader(256, 224, 10, torch.device('cuda'), n=len(dls.train))
    if a.burn:
        from handover_probe import plain_loop
        from dali_fastai.measure import _endless
        small = SyntheticLoader(32, 224, 10, torch.device('cuda'), n=len(dls.train))
        print(f"== {torch.cuda.get_device_name()} | resnet18, 224 px | synthetic batch, {a.burn} cores busy or not | {a.opt} optimizer", flush=True)
        for run in range(2):
            for busy in (0, a.burn):
                with (busy_cores(dls.path, busy) if busy else contextlib.nullcontext()):
                    print(f"  {busy:>2} busy | Learner.fit bs 256: {step_times(DataLoaders(synth, synth), 256, opt=a.opt)}\n"
                          f"           Learner.fit bs 32: {step_times(DataLoaders(small, small), 32, opt=a.opt)}\n"
                          f"           plain loop bs 256: {plain_loop(_endless(synth), 'resnet18'):,.0f} img/s", flush=True)
        raise SystemExit
    print(f"== {torch.cuda.get_device_name()} | {a.arch}, bs 256, 224 px | {len(dls.train)} training batches an epoch | {kw} | {a.opt} optimizer"
          f"{' | progress bar' if a.bar else ''}{' | no validation' if a.no_valid else ''}", flush=True)
    rows = [('synthetic', DataLoaders(synth, synth), []), ('DaliDataLoader', dls, [])] + ([(' '.join(a.versus), make(**versus), [])] if versus else [])
    for k in a.lever:
        d = make(); train,cbs = LEVERS[k](d.train)
        rows.append((k, DataLoaders(train, d.valid), cbs))
    for run in range(2):
        for name,d,cbs in rows: print(f"  {name:<15} {step_times(d, 256, opt=a.opt, bar=a.bar, valid=not a.no_valid, cbs=cbs, arch=a.arch)}", flush=True)
    if a.bar or a.no_valid: raise SystemExit
    print("== PyTorch operations that synchronized the device, DaliDataLoader-fed fit")
    print(sync_sites(dls))
