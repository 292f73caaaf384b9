"""Does taking a batch from dali_fastai make the host wait for the GPU? And is the training gap fastai's or the loader's?
On the GPU machine, in one run:

    python tools/handover_probe.py [--arch resnet18]

1. `next()` and dropping the batch, timed on the host while ~50 ms of GPU work is queued on PyTorch's stream: a loader
   that waits for that work (a synchronization) stops the host from queueing the next step while the GPU runs this one.
   For the bare DALI iterator, for `DaliDataLoader`, and for a synthetic batch.
2. A plain PyTorch loop (bf16 autocast, channels_last, SGD), no fastai, fed by a synthetic batch kept on the GPU, by
   `DaliDataLoader` and by the bare DALI iterator; then fastai's `Learner.fit` (`training_throughput`) fed by the
   synthetic batch and by `DaliDataLoader`: where the step loses its time.

`--short`: only `next()` of `DaliDataLoader` and `Learner.fit` against the ceiling, for one setting (`--kw name=value`,
`--legacy` for DALI's legacy executor, DALI_* environment variables set by the caller). `--threaded`: training with
DALI's `next()` on a thread of its own, against without. `--cpu-decode`: the training recipe's decode and crop on DALI's
CPU backend. `--parts`: which step of the bare iterator's `next()` waits (share_outputs, from_dlpack, release_outputs,
schedule_run, dropping the batch). `--decoder-kw name=value ...`: more of DALI's arguments for the training decoder (the hardware decoder's
`preallocate_width_hint`/`preallocate_height_hint`, `device_memory_padding`, `host_memory_padding`: nvJPEG frees and
reallocates buffers that are too small, and a free synchronizes the device); with `--train-if-free`, `--short` trains
only when `next()` no longer waits. `--parts` with `--decoder-kw preallocate_width_hint=1 preallocate_height_hint=1`
shows the wait that the library's default hints (`pipeline.HW_DECODER_HINT`) remove, and the device memory each hint
takes. The numbers of 2026-11-24 (H100) are in nbs/images/step_wait_h100.txt and the bench notebook's "Second round"
and "The step no longer waits"."""
import argparse, queue, statistics, threading, time
import torch, torch.nn.functional as F, torchvision
from nvidia.dali import types
from fastai.callback.core import Callback
from fastai.data.core import DataLoaders

from dali_fastai.measure import STEADY_PACE, bench_images, training_throughput, side_by_side, SyntheticLoader, _endless
from dali_fastai.data import DaliDataLoaders


def cycles_per_ms()->float:
    "GPU clock cycles `torch.cuda._sleep` spins a millisecond"
    torch.cuda.synchronize(); t = time.perf_counter(); torch.cuda._sleep(int(1e8)); torch.cuda.synchronize()
    return 1e8 / (1e3*(time.perf_counter() - t))


def queue_work(cpm:float, ms:float, stream=None):
    "Wait for the GPU to be idle, then queue `ms` milliseconds of work on `stream` (None: the current one)"
    torch.cuda.synchronize()
    with torch.cuda.stream(stream or torch.cuda.current_stream()): torch.cuda._sleep(int(ms*cpm))


def blocking(it, cpm:float, queued_ms:float=50, n:int=7, work=None, take_on=None)->str:
    "Host milliseconds of `next(it)` and of dropping the batch, with `queued_ms` of GPU work queued before on stream `work` (None: the current one); `next` called with `take_on` current"
    for _ in range(3): next(it)
    take,drop = [],[]
    for _ in range(n):
        queue_work(cpm, queued_ms, work)
        t0 = time.perf_counter()
        with torch.cuda.stream(take_on or torch.cuda.current_stream()): b = next(it)
        t1 = time.perf_counter(); del b; t2 = time.perf_counter()
        torch.cuda.synchronize(); take.append(t1 - t0); drop.append(t2 - t1)
    return f"next() {1e3*statistics.median(take):6.2f} ms, drop {1e3*statistics.median(drop):6.2f} ms (of {queued_ms:.0f} ms queued)"


def parts(it, cpm:float, queued_ms:float=50, n:int=7)->str:
    "Host milliseconds of each step of the bare DALI iterator's `next()`, with `queued_ms` of GPU work queued on PyTorch's stream: which one waits"
    for _ in range(3): next(it)
    p,steps = it._pipes[0],{k: [] for k in ('share_outputs', 'from_dlpack', 'release_outputs', 'schedule_run', 'drop')}
    for _ in range(n):
        queue_work(cpm, queued_ms)
        with p._check_api_type_scope(types.PipelineAPIType.ITERATOR):  # the scope DALI's iterator calls these in
            t = [time.perf_counter()]
            outs = p.share_outputs(); t.append(time.perf_counter())
            ts = [torch.from_dlpack(o.as_tensor()) for o in outs]; t.append(time.perf_counter())
            p.release_outputs(); t.append(time.perf_counter())
            p.schedule_run(); t.append(time.perf_counter())
            del ts, outs; t.append(time.perf_counter())
        for k,a,b in zip(steps, t, t[1:]): steps[k].append(b - a)
    return ', '.join(f"{k} {1e3*statistics.median(v):.2f}" for k,v in steps.items()) + f" ms (of {queued_ms:.0f} ms queued)"


def xy(b):
    "Images and class targets of a fastai batch, or of a bare DALI iterator's (its item index as the class)"
    if isinstance(b, list): return b[0]['images'], (b[0]['index'].squeeze(-1).long() % 10)
    return b[0].as_subclass(torch.Tensor), b[1].as_subclass(torch.Tensor)


def plain_loop(batches, arch:str, n:int=40, warmup:int=10)->float:
    "Images a second through a plain PyTorch training loop"
    model = getattr(torchvision.models, arch)(num_classes=10).cuda().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    seen = 0
    for i,b in enumerate(batches):
        if i == warmup: torch.cuda.synchronize(); t0 = time.perf_counter()
        x,y = xy(b)
        with torch.autocast('cuda', dtype=torch.bfloat16): loss = F.cross_entropy(model(x.contiguous(memory_format=torch.channels_last)), y)
        opt.zero_grad(set_to_none=True); loss.backward(); opt.step()
        if i >= warmup: seen += len(x)
        if i == warmup + n - 1: torch.cuda.synchronize(); return seen / (time.perf_counter() - t0)


def threaded(it, depth:int=2):
    "The batches of `it`, taken by a thread of their own `depth` ahead: the host thread never waits inside DALI"
    q,stop = queue.Queue(depth),object()
    def work():
        try:
            for b in it: q.put(b)
        finally: q.put(stop)
    threading.Thread(target=work, daemon=True).start()
    while (b := q.get()) is not stop: yield b


class Threaded:
    "A loader whose batches come through `threaded` (a diagnostic: a new loader copy each epoch, so no thread outlives its loader)"
    def __init__(self, dl): self.dl = dl
    def __iter__(self): return threaded(iter(self.dl.new()))
    def __len__(self): return len(self.dl)
    def __getattr__(self, k): return getattr(self.dl, k)


class OnStream(Callback):
    "Fit on a non-default CUDA stream"
    order = -100
    def before_fit(self): self.ctx = torch.cuda.stream(torch.cuda.Stream()); self.ctx.__enter__()
    def after_fit(self): self.ctx.__exit__(None, None, None)


if __name__ == '__main__':
    import fastai.callback.progress  # noqa: F401 (Learner.no_bar)
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--arch', default='resnet18')
    p.add_argument('--short', action='store_true', help="only: next() of DaliDataLoader, and Learner.fit against the ceiling")
    p.add_argument('--threaded', action='store_true', help="only: training with DALI's next() in a thread of its own, against without")
    p.add_argument('--legacy', action='store_true', help="DALI's legacy executor (exec_dynamic=False)")
    p.add_argument('--cpu-decode', action='store_true', help="decode and crop on DALI's CPU threads, augment on the GPU")
    p.add_argument('--decoder-kw', nargs='*', default=[], help="name=value for the training decoder (preallocate hints, memory padding)")
    p.add_argument('--train-if-free', action='store_true', help="--short: train only if next() waited under 20 ms")
    p.add_argument('--parts', action='store_true', help="only: which step of the bare iterator's next() waits")
    p.add_argument('--kw', nargs='*', default=[], help="name=value for DaliDataLoaders.from_folder")
    a = p.parse_args()
    if a.legacy:  # a diagnostic, not the library's way: every pipeline built with exec_dynamic=False
        import functools, nvidia.dali.pipeline, dali_fastai.pipeline as dp
        dp.Pipeline = functools.partial(nvidia.dali.pipeline.Pipeline, exec_dynamic=False)
    if a.cpu_decode:  # a diagnostic too: the training recipe's decode-and-crop on the CPU backend, then to the GPU
        import dali_fastai.pipeline as dp, dali_fastai.translate as dt
        dt.decode_random_crop = lambda encoded, size, device_id, **k: dp.decode_random_crop(encoded, size, None, **k).gpu()
    if a.decoder_kw:  # a diagnostic too: the training recipe's decoder with more of DALI's arguments
        import functools, dali_fastai.pipeline as dp, dali_fastai.translate as dt
        dt.decode_random_crop = functools.partial(dp.decode_random_crop, **{k: int(v) for k,v in (x.split('=') for x in a.decoder_kw)})
    kw = {k: (float(v) if '.' in v else int(v)) for k,v in (x.split('=') for x in a.kw)}
    path,synth = bench_images(),SyntheticLoader(256, 224, 10, torch.device('cuda'))
    dls = DaliDataLoaders.from_folder(path, bs=256, size=224, device='gpu', seed=0, **{**STEADY_PACE, **kw})
    cpm = cycles_per_ms()
    print(f"== {torch.cuda.get_device_name()} | {a.arch}, bs 256, 224 px | {cpm:,.0f} cycles/ms", flush=True)
    if a.parts:
        free = torch.cuda.mem_get_info()[0]
        took = parts(dls.train.new()._iterator(), cpm)
        print(f"-- {kw} {a.decoder_kw}: bare iterator {took}; device memory used {(free - torch.cuda.mem_get_info()[0])/2**30:.2f} GiB", flush=True)
        raise SystemExit
    if a.threaded:
        sdls,tdls = DataLoaders(synth, synth),DataLoaders(Threaded(dls.train), Threaded(dls.valid))
        rows = {'plain loop, synthetic': lambda: plain_loop(_endless(synth), a.arch),
                'plain loop, DaliDataLoader': lambda: plain_loop(_endless(dls.train.new()), a.arch),
                'plain loop, DaliDataLoader in a thread': lambda: plain_loop(threaded(_endless(dls.train.new())), a.arch),
                'Learner.fit, synthetic': lambda: training_throughput(sdls, a.arch, c=10),
                'Learner.fit, DaliDataLoader': lambda: training_throughput(dls, a.arch, c=dls.c),
                'Learner.fit, DaliDataLoader in a thread': lambda: training_throughput(tdls, a.arch, c=dls.c)}
        res = {k: [] for k in rows}
        for run in range(2):
            for k,f in rows.items(): res[k].append(f())
        for k,v in res.items(): print(f"  {k:<46}" + '  '.join(f"{r:>8,.0f}" for r in v), flush=True)
        raise SystemExit
    if a.short:
        import os
        env = ' '.join(f"{k}={v}" for k,v in os.environ.items() if k.startswith('DALI_'))
        waits = blocking(_endless(dls.train.new()), cpm)
        print(f"-- legacy={a.legacy} cpu_decode={a.cpu_decode} {kw} {a.decoder_kw} {env}: DaliDataLoader {waits}", flush=True)
        if a.train_if_free and float(waits.split()[1]) > 20: raise SystemExit
        sdls = DataLoaders(synth, synth)
        print(f"   loader alone {side_by_side({'dl': dls.train.new()}, torch.device('cuda'))['dl']:,.0f} img/s", flush=True)
        r = [(training_throughput(sdls, a.arch, c=10), training_throughput(dls, a.arch, c=dls.c)) for _ in range(2)]
        print('   Learner.fit ' + ', '.join(f"{d:,.0f} of {s:,.0f} img/s ({d/s:.1%})" for s,d in r), flush=True)
        raise SystemExit
    print("== 1. does taking a batch wait for the GPU?")
    print(f"  synthetic           {blocking(_endless(synth), cpm)}")
    print(f"  bare DALI iterator  {blocking(_endless(dls.train.new()._iterator()), cpm)}")
    print(f"  DaliDataLoader      {blocking(_endless(dls.train.new()), cpm)}", flush=True)
    side,side2 = torch.cuda.Stream(),torch.cuda.Stream()
    print(f"  bare, work on the default stream, next() on a side stream   {blocking(_endless(dls.train.new()._iterator()), cpm, take_on=side)}")
    print(f"  bare, work and next() on a side stream                      {blocking(_endless(dls.train.new()._iterator()), cpm, work=side, take_on=side)}")
    print(f"  bare, work on a side stream, next() on another              {blocking(_endless(dls.train.new()._iterator()), cpm, work=side, take_on=side2)}")
    print(f"  DaliDataLoader, work and next() on a side stream            {blocking(_endless(dls.train.new()), cpm, work=side, take_on=side)}", flush=True)
    print("== 2. images/s: plain PyTorch loop, then fastai's Learner.fit; runs taken in turn")
    sdls = DataLoaders(synth, synth)
    def on(stream, f):
        with torch.cuda.stream(stream): return f()
    rows = {'plain loop, synthetic': lambda: plain_loop(_endless(synth), a.arch),
            'plain loop on a side stream, DaliDataLoader': lambda: on(side, lambda: plain_loop(_endless(dls.train), a.arch)),
            'Learner.fit on a side stream, DaliDataLoader': lambda: training_throughput(dls, a.arch, c=dls.c, cbs=[OnStream()]),
            'plain loop, DaliDataLoader': lambda: plain_loop(_endless(dls.train), a.arch),
            'plain loop, bare DALI iterator': lambda: plain_loop(_endless(dls.train.new()._iterator()), a.arch),
            'Learner.fit, synthetic': lambda: training_throughput(sdls, a.arch, c=10),
            'Learner.fit, DaliDataLoader': lambda: training_throughput(dls, a.arch, c=dls.c)}
    res = {k: [] for k in rows}
    for run in range(2):
        for k,f in rows.items(): res[k].append(f())
    for k,v in res.items(): print(f"  {k:<46}" + '  '.join(f"{r:>8,.0f}" for r in v), flush=True)
