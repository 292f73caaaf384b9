"""Training throughput of dali_fastai under DDP, 1 GPU against N, side by side in one run:

    python tools/ddp_bench.py --compare 2      # starts every case below with torchrun on 1 and 2 GPUs, then prints a table
    python tools/ddp_bench.py --compare max    # on 1, 2, 4, ... and all the GPUs this machine has: one table, a ratio per count

or one case:  torchrun --nproc_per_node N tools/ddp_bench.py [--loader-only | --synthetic | --sync-bn]

Every rank reads its own shard (`DaliDistributed`); `bs` is per GPU. Epoch 1 warms up (cuDNN, DALI); the later epochs
are timed. `--loader-only` times the sharded training loader alone (no model), to tell a data-bound run from a
compute-bound one; `--synthetic` times the same training step in a plain PyTorch DDP loop on one random batch kept on
the GPU (no loader, no fastai): the scaling this host allows. Two more cases separate the loader from the model and
from fastai's loop: `--plain-dali` runs that plain loop on this rank's shard of `DaliDataLoaders` (the loader's cost
to training, without fastai), and `--fastai-model` gives either plain loop the model `vision_learner` trains (the
resnet50 body with fastai's head) instead of torchvision's resnet50 (the model's cost). For the fastai cases,
`--no-bar` fits without fastai's progress bar (which reads the loss with `.item()` every batch), `--fused-adamw`
with PyTorch's fused AdamW instead of fastai's Adam, and `--fast-step` with dali_fastai's `FastStep(graph=False)` callback, `--graph` with `FastStep(graph=True)` (forward and backward as
CUDA graphs; DDP's all-reduce runs from its hooks as the replayed backward hands over the gradients), `--auto` with
`FastStep()`, whose race keeps the captured step where it is faster. `--synthetic --graph` captures the plain loop's
model the same way: the ceiling of a captured step on this host. `--compare`
keeps each case's img/s in `--out` (JSON) as it goes and skips those already there, so a run cut short goes on where
it stopped when started again (`--fresh` starts over, `--cases 1,3` runs only those rows, `--counts 1,4` only those
counts of GPUs; `--num-threads N` and `--no-priority-stream` set the
loaders' DALI threads and stream, in every case); it makes the image set large enough that each rank trains on
about `--images-per-rank` images an epoch on the most GPUs (an epoch of several seconds). Every img/s is the steady
pace of the epochs after the first (a fit's start is not in it); each case's line also gives the img/s of all its epochs,
the first included, which is what a short run waits for. `--arch resnet18` (or resnet34) trains a lighter model than
resnet50 in every case. The numbers of 2026-11-27 are in nbs/images/ddp_h200x4_20261127.txt and
ddp_h200x4_20261127b.txt (4 H200s), ddp_levers_h100x4_20261127.txt (4 H100s: `--hw-decoder-load`, `--no-kept-decoder`,
`--arch resnet18`) and ddp_h200x2_20261127b.txt (2 H200s; those of 2026-11-24 in ddp_h200x2.txt), and the distributed
notebook's "Throughput"."""
import argparse, contextlib, json, math, os, subprocess, sys, tempfile, time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from fastai.callback.core import Callback
from fastai.callback.fp16 import MixedPrecision  # noqa: F401 (adds Learner.to_bf16)
from fastai.callback.schedule import fit_one_cycle  # noqa: F401 (adds Learner.fit_one_cycle)
from fastai.callback.progress import ProgressCallback  # noqa: F401 (adds Learner.no_bar)
from fastai.distributed import *  # noqa: F401,F403 (adds Learner.distrib_ctx)
from fastai.metrics import accuracy
from fastai.optimizer import OptimWrapper
from fastai.vision.learner import vision_learner, create_vision_model
from torchvision.models import resnet18, resnet34, resnet50

ARCHS = {'resnet18': resnet18, 'resnet34': resnet34, 'resnet50': resnet50}

import dali_fastai.capture
import dali_fastai.loader
from dali_fastai.measure import BENCH_PHOTOS, bench_images
from dali_fastai.distributed import DaliDistributed
from dali_fastai.faststep import FastStep
from dali_fastai.data import DaliDataLoaders
from dali_fastai.epoch import priority_stream
from dali_fastai.sessionbench import build_seconds, start_costs


class EpochTimer(Callback):
    "Wall time of every training phase, synchronised with the GPU"
    def before_fit(self): self.times,self.decoded = [],[]
    def before_train(self): torch.cuda.synchronize(); self.start = time.perf_counter()
    def after_train(self):
        torch.cuda.synchronize(); self.times.append(time.perf_counter() - self.start)
        self.decoded.append(getattr(self.dls.train, 'decoding', '?'))  # where this epoch's JPEGs were decoded


class LoaderWait(Callback):
    "Host seconds of each training phase from one batch's end to the next one's start: the loader's hand-over as the host sees it, no GPU sync added (what a rule choosing `decode_on` would read)"
    order = 99
    def before_fit(self): self.waits,self.t = [],None
    def before_train(self): self.waits.append(0.); self.t = None
    def before_batch(self):
        if self.training and self.t is not None: self.waits[-1] += time.perf_counter() - self.t
    def after_batch(self):
        if self.training: self.t = time.perf_counter()


def loader_epochs(dl, epochs:int)->list:
    "Wall time of `epochs` epochs of `dl` (this rank's shard) alone, reading every batch onto the GPU"
    times = []
    for _ in range(epochs):
        torch.cuda.synchronize(); start = time.perf_counter()
        for _ in dl: pass
        torch.cuda.synchronize(); times.append(time.perf_counter() - start)
    return times


def fit_epochs(dls, epochs:int, world:int, sync_bn:bool, bar:bool=True, fused:bool=False, fast_step:bool=False,
               graph:bool|str=False, # `FastStep(graph=...)`: True, False, or 'auto' (its default: captured where faster)
               arch:str='resnet50', # the model, one of `ARCHS`
               broadcast_buffers:bool=False, # `FastStep(broadcast_buffers=...)`: DDP's broadcast of BatchNorm's statistics at every forward
               bucket_view:bool=True, # `FastStep(bucket_view=...)`: DDP built with `gradient_as_bucket_view=True` (FastStep cases only: `VIEWS_REFUSED`)
               whole_step:bool=True, # `FastStep(whole_step=...)`: the loss and the backward (DDP's all-reduce) in the forward's graph
              )->list:
    "Wall time of the training phase of each of `epochs` epochs of an `arch` (bf16, channels_last) fit, and `start_costs` after it"
    timer,wait = EpochTimer(),LoaderWait()
    kw = dict(opt_func=partial(OptimWrapper, opt=torch.optim.AdamW, fused=True)) if fused else {}
    cbs = [DaliDistributed(), timer, wait, *([FastStep(graph=graph, broadcast_buffers=broadcast_buffers, bucket_view=bucket_view, whole_step=whole_step)]
                                             if fast_step or graph else [])]
    learn = vision_learner(dls, ARCHS[arch], metrics=accuracy, pretrained=False, cbs=cbs, **kw).to_bf16()
    learn.model = learn.model.to(memory_format=torch.channels_last)
    # one GPU: a plain fit (fastai's DistributedTrainer assumes a DDP-wrapped model, which one process does not get)
    with learn.distrib_ctx(sync_bn=sync_bn) if world > 1 else contextlib.nullcontext(), \
         contextlib.nullcontext() if bar else learn.no_bar():
        learn.fit_one_cycle(epochs, 1e-3)
    return timer.times,{**start_costs(learn), 'host waits for batches': wait.waits},timer.decoded


def plain_model(fastai_model:bool, c:int=10, arch:str='resnet50'):
    "torchvision's `arch`, or the `arch` `vision_learner` builds (fastai's head), untrained, in training mode"
    # `.train()`: `create_vision_model` leaves its body in eval mode (the dummy pass that counts its features), and
    # `Learner.fit` sets training mode but a plain loop must (without it, the rows of nbs/images/ddp_h200x2.txt marked wrong)
    return (create_vision_model(ARCHS[arch], c, pretrained=False) if fastai_model else ARCHS[arch](num_classes=c)).train()


def plain_epochs(epochs:int, batches, # `batches()`: one epoch's (x, y) batches, on this rank's GPU
                 world:int, fastai_model:bool,
                 loader_stream:bool=False, # the batches come from a DALI loader, which runs the step on `priority_stream`
                 graph:bool=False, # the module's forward and backward captured as CUDA graphs, as `FastStep(graph=True)` does
                 spent:dict|None=None, # gets 'graph capture': the seconds `make_graphed_callables` took
                 arch:str='resnet50', # the model, one of `ARCHS`
                )->list:
    "Wall time of `epochs` epochs of `arch` steps (bf16 autocast, channels_last, Adam) in a plain PyTorch (DDP) loop"
    dev = torch.device('cuda', torch.cuda.current_device())
    model = plain_model(fastai_model, arch=arch).to(dev, memory_format=torch.channels_last)
    if world > 1:
        torch.distributed.init_process_group('nccl', device_id=dev)
        # DDP built on the stream the loop's steps run on: it keeps the parameters' AccumulateGrad nodes, made on the stream
        # it is built on, and a backward on another stream waits across streams for each (the distributed notebook says more)
        # (a capture runs on a stream of its own: the captured loop runs on the loader's stream too)
        with priority_stream(dev, on=loader_stream or graph): model = DistributedDataParallel(model, device_ids=[dev.index])
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    inner = model.module if world > 1 else model
    times,steps = [],0
    with priority_stream(dev, on=graph):
        for _ in range(epochs):
            torch.cuda.synchronize(); start = time.perf_counter()
            for x,y in batches():
                x = x.as_subclass(torch.Tensor).contiguous(memory_format=torch.channels_last)
                # autocast's cache off: a graph cannot hold it (as `GraphCapture` captures)
                with torch.autocast('cuda', dtype=torch.bfloat16, cache_enabled=not graph):
                    if graph and steps == 3:
                        a = time.perf_counter(); torch.cuda.make_graphed_callables(inner, (x,), allow_unused_input=True)
                        if spent is not None: spent['graph capture'] = time.perf_counter() - a
                    loss = F.cross_entropy(model(x), y.as_subclass(torch.Tensor))
                opt.zero_grad(); loss.backward(); opt.step(); steps += 1
            torch.cuda.synchronize(); times.append(time.perf_counter() - start)
    if world > 1: torch.distributed.destroy_process_group()
    return times


def synthetic_batches(n_batches:int, bs:int, size:int):
    "`batches` for `plain_epochs`: one random batch kept on the GPU, `n_batches` times an epoch"
    x = torch.randn(bs, 3, size, size, device='cuda').to(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (bs,), device='cuda')
    return lambda: ((x, y) for _ in range(n_batches))


CASES = [('the sharded loader alone', ['--loader-only']),
         ('plain PyTorch DDP, a random batch kept on the GPU', ['--synthetic']),
         ("plain PyTorch DDP, a random batch, fastai's model", ['--synthetic', '--fastai-model']),
         ("plain PyTorch DDP, a random batch, fastai's model, captured", ['--synthetic', '--fastai-model', '--graph']),
         ("plain PyTorch DDP fed by dali_fastai, fastai's model", ['--plain-dali', '--fastai-model']),
         ('fastai + dali_fastai + FastStep(graph=False), `distrib_ctx(sync_bn=False)`', ['--fast-step']),
         ('fastai + dali_fastai + FastStep(graph=True), `distrib_ctx(sync_bn=False)`', ['--fast-step', '--graph']),
         ("fastai + dali_fastai + FastStep(graph='auto') (its default), `distrib_ctx(sync_bn=False)`", ['--fast-step', '--auto']),
         ('fastai + dali_fastai + FastStep(graph=True, whole_step=False), the model alone captured (DDP\'s all-reduce not)', ['--fast-step', '--graph', '--model-graph']),
         ('fastai + dali_fastai, `distrib_ctx(sync_bn=False)`', []),
         ("fastai + dali_fastai, `distrib_ctx()` (fastai's default `sync_bn=True`)", ['--sync-bn'])]
# the cases `--no-bucket-view` applies to: FastStep asks DDP for bucket views for its PyTorch optimizer; fastai's own
# refuses them (its `zero_grad` detaches each gradient in place) and the plain loops build their DDP without them
VIEW_CASES = [i + 1 for i,(_,extra) in enumerate(CASES) if '--fast-step' in extra]
VIEWS_REFUSED = (f"--no-bucket-view: FastStep's fastai cases only (with --compare, --cases among {','.join(map(str, VIEW_CASES))}): "
                 "the other cases build DDP with its default already (fastai's own optimizer refuses DDP's bucket views)")


OUT = 'ddp_bench.json'  # `--compare`'s default file of results

def run_case(n_gpus:int, args:list)->float:
    "img/s (all ranks) of one case on `n_gpus`, in its own torchrun"
    with tempfile.TemporaryDirectory() as d:
        res = Path(d)/'res.json'
        cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node', str(n_gpus), __file__, *args,
               '--result', str(res)]
        subprocess.run(cmd, check=True)
        return json.loads(res.read_text())['img_s']


def gpu_counts(most:int)->list:
    "1, 2, 4, ... up to `most`, and `most` itself"
    return sorted({1, most} | {2**k for k in range(1, most.bit_length()) if 2**k <= most})


def n_per_class_for(images_per_rank:int, most:int, n_classes:int=len(BENCH_PHOTOS), least:int=2000)->int:
    "Images a class of `bench_images` so that each of `most` ranks trains on about `images_per_rank` an epoch (4 in 5 go to train/)"
    return max(least, math.ceil(images_per_rank*most/(0.8*n_classes)))


def table(rows:dict, counts:list, bs:int, arch:str='resnet50')->str:
    "The markdown table of `rows` ({case name: {n_gpus: img/s}}): img/s on each count of GPUs, and each count against 1"
    head = ' | '.join(f'{n} GPU{"s" if n > 1 else ""}' + (f' | {n} vs 1' if n > 1 else '') for n in counts)
    lines = [f"| img/s, {arch} bf16, bs {bs}/GPU | {head} |", '|---' * (1 + 2*len(counts) - 1) + '|']
    for name,_ in CASES:
        got = rows.get(name, {})
        cells = []
        for n in counts:
            v = got.get(str(n))
            cells.append('' if v is None else f'{v:,.0f}')
            if n > 1: cells.append('' if v is None or not got.get('1') else f"{v/got['1']:.2f}x")
        lines.append(f"| {name} | {' | '.join(cells)} |")
    return '\n'.join(lines)


def compare(counts:list, args:list, bs:int, out:Path, fresh:bool=False,
            cases:list|None=None, # numbers (1-based) of the cases of `CASES` to run; None: all of them
            arch:str='resnet50', # the model the cases train (in `args` too), for the table's title
           ):
    "Every case of `CASES` on each of `counts` GPUs (with one GPU, sync_bn changes nothing: fastai's BatchNorm stays), kept in `out` as they finish; then one table"
    rows = {} if fresh or not out.exists() else json.loads(out.read_text())
    for i,(name,extra) in enumerate(CASES):
        if cases and i + 1 not in cases: continue
        for n in counts:
            got = rows.setdefault(name, {})
            if str(n) in got: continue
            same = rows.get(CASES[i-1][0], {}).get('1') if extra == ['--sync-bn'] and n == 1 else None  # one GPU: the case above
            got[str(n)] = same if same is not None else run_case(n, args + extra)
            out.write_text(json.dumps(rows, indent=1))
        print(f"ddp_bench: {i + 1} of {len(CASES)} cases done ({out})", flush=True)  # the numbers so far are in the lines above
    print('\n' + table(rows, counts, bs, arch))


def loader_builds(dls)->dict:
    "Each loader's pipeline builds so far: how many, and their seconds (the first holds the JPEG decoder's start)"
    return {name: (dl._source.builds, dl._source.build_seconds) for name,dl in (('training', dls.train), ('validation', dls.valid))}


def decoding(dl, each:list|None=None)->str:
    "Where the training loader decoded (each epoch's where known, else at the end), and the host's waits for DALI's CPU threads it weighed (`decode_on='auto'`)"
    where = ', '.join(each) if each and len(set(each)) > 1 else dl.decoding
    s = dl._source
    paces = '' if not s.paces else "; a batch's seconds (a whole pass's second half, GPU synced) " + ', '.join(
        f"on the {k.upper()}'s decoders {v:.4f}" for k,v in s.paces.items() if v is not None)
    return f"; training decoded on the {where} (host waited {s.waited:.2f} s for the CPU's{paces})"


def paid(costs:dict, builds:dict)->str:
    "What a case's start paid for, as its line ends: `start_costs`' seconds (the first epoch holds them), each loader's builds, and a list's values an epoch (the host's waits for batches)"
    said = [f"{k} (each epoch) {', '.join(f'{x:.2f}' for x in v)} s" if isinstance(v, list) else f"{k} {v:.2f} s"
            for k,v in costs.items() if v]
    said += [f"{k} {n} build(s) {v:.2f} s" for k,(n,v) in builds.items() if n]
    return f"; of which {', '.join(said)}" if said else ''


QUIET_CALLS = {7, 23, 35, 202, 230, 232, 270, 271, 281}  # x86-64 system calls a thread waits in: poll, select, nanosleep, futex, clock_nanosleep, epoll_wait, pselect6, ppoll, epoll_pwait

def threads_now(skip:int)->list:
    """This process's threads but `skip` (a native id) at this moment, from /proc: those running or in a system call other
    than a wait (16 is ioctl, the CUDA driver's), each with its innermost Python frames if it runs Python; the rest counted by name"""
    import collections, sys, threading, traceback
    frames = sys._current_frames()
    py = {t.native_id: (t.name, frames.get(t.ident)) for t in threading.enumerate()}
    busy,waiting = [],collections.Counter()
    for task in Path('/proc/self/task').iterdir():
        tid = int(task.name)
        if tid == skip: continue
        try: name,state,call = (task/'comm').read_text().strip(),(task/'stat').read_text().rsplit(')', 1)[1].split()[0],(task/'syscall').read_text().split()[0]
        except OSError: continue  # it ended meanwhile
        if state == 'R' or (call.isdigit() and int(call) not in QUIET_CALLS):
            pyname,frame = py.get(tid, (None, None))
            where = ' <- '.join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(traceback.extract_stack(frame)[-3:])) if frame else ''
            busy.append(f"{name}[{tid}]{f' (Python thread {pyname!r})' if pyname else ''} state {state}, system call {call}{': ' + where if where else ''}")
        else: waiting[name] += 1
    return busy + [f"waiting: {dict(waiting)}"]


def recapture_each(rank:int):
    """A probe's switch (`--recapture`): every inference forward after a shape's first is captured anew (its graph dropped after
    the replay), a capture another thread broke is tried again without end, and at the first error of a capture that fails this
    rank prints what every other thread of the process is doing then (`threads_now`): many captures a run, each a sample of
    what runs beside one"""
    import threading
    from dali_fastai.capture import ForwardCapture
    ForwardCapture.retries = 1 << 30
    forward,eager = ForwardCapture.forward,ForwardCapture._eager
    def each(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        self.graphs.clear()  # the shape's next forward captures again
        return out
    def caught(self, *args, **kwargs):
        try: return eager(self, *args, **kwargs)
        except Exception:
            if torch.cuda.is_current_stream_capturing():
                print(f"ddp_bench rank {rank}: a capture failed; beside it:\n  " + '\n  '.join(threads_now(threading.get_native_id())), flush=True)
            raise
    ForwardCapture.forward,ForwardCapture._eager = each,caught


def every_rank_says(rank:int):
    """A probe's switch (`--every-rank-says`): `GraphCapture` and `ForwardCapture` say a failed capture on every rank, not on
    rank 0 only; each warning this process prints names its rank, each inference-forward capture prints its batch's shape,
    one that another thread broke (tried again at the next forward) is said, and so is a run of Python's garbage collector
    during a capture (what it frees may sync the device)"""
    import gc, warnings
    from dali_fastai.capture import ForwardCapture
    dali_fastai.capture.rank_distrib = lambda: 0
    show = warnings.showwarning
    warnings.showwarning = lambda message, *args, **kwargs: show(f"rank {rank}: {message}", *args, **kwargs)
    capture = ForwardCapture._capture
    def told(self, xs, key):
        print(f"ddp_bench rank {rank}: capturing the inference forward of a {tuple(xs[0].shape)} batch", flush=True)
        return capture(self, xs, key)
    ForwardCapture._capture = told
    again = ForwardCapture._again
    def broken(self, why):
        print(f"ddp_bench rank {rank}: {why}; tried again at the next forward of that shape", flush=True)
        return again(self, why)
    ForwardCapture._again = broken
    def collecting(phase, info):
        if phase == 'start' and torch.cuda.is_current_stream_capturing():
            print(f"ddp_bench rank {rank}: the garbage collector ran (generation {info['generation']}) during a CUDA graph capture", flush=True)
    gc.callbacks.append(collecting)


def main():
    p = argparse.ArgumentParser()
    p.add_argument('--arch', default='resnet50', choices=sorted(ARCHS), help="the model (default: resnet50)")
    p.add_argument('--path', default=None); p.add_argument('--bs', type=int, default=128); p.add_argument('--size', type=int, default=224)
    p.add_argument('--n-per-class', type=int, default=None, help="images a class of the generated set (default: 2000; "
                   "with --compare, enough for --images-per-rank)"); p.add_argument('--epochs', type=int, default=4)
    p.add_argument('--loader-only', action='store_true'); p.add_argument('--synthetic', action='store_true')
    p.add_argument('--plain-dali', action='store_true', help="the plain DDP loop fed by this rank's shard of the loader")
    p.add_argument('--fastai-model', action='store_true', help="plain loops: vision_learner's resnet50 (fastai's head)")
    p.add_argument('--sync-bn', action='store_true', help="fastai's distrib_ctx default: BatchNorm synchronised across ranks")
    p.add_argument('--no-bar', action='store_true', help="fastai cases: fit without the progress bar (it reads the loss every batch)")
    p.add_argument('--fused-adamw', action='store_true', help="fastai cases: PyTorch's fused AdamW (OptimWrapper) instead of fastai's Adam")
    p.add_argument('--fast-step', action='store_true', help="fastai cases: with dali_fastai's FastStep callback")
    p.add_argument('--graph', action='store_true', help="fastai cases: with FastStep(graph=True), forward and backward as CUDA "
                   "graphs; --synthetic: the plain loop's model captured so (the ceiling of a captured step)")
    p.add_argument('--auto', action='store_true', help="fastai cases: with FastStep() (graph='auto'), captured where its race "
                   "finds the captured step faster; --fast-step alone is FastStep(graph=False)")
    p.add_argument('--compare', default=None, help="run every case on 1, 2, 4, ... GPUs up to this many ('max': all this "
                   "machine has), print one table")
    p.add_argument('--images-per-rank', type=int, default=9000, help="--compare: training images each rank reads an epoch "
                   "on the most GPUs (default: 9000: about 3 s at the 3,000 img/s a GPU of the distributed notebook's tables)")
    p.add_argument('--out', default=OUT, help="--compare: the cases' img/s, kept as they finish (default: ddp_bench.json)")
    p.add_argument('--fresh', action='store_true', help="--compare: run every case again, not only those missing from --out")
    p.add_argument('--cases', default=None, help="--compare: only these cases, by their row in the table, e.g. 1,3,5 (default: all)")
    p.add_argument('--counts', default=None, help="--compare: only these counts of GPUs, e.g. 1,4 on a 4-GPU machine whose 2-GPU "
                   "rows are not needed (default: 1, 2, 4, ... up to --compare's)")
    p.add_argument('--num-threads', type=int, default=None, help="the loaders' DALI CPU threads a pipeline (default: "
                   "default_threads(decoding): the cores this process may use, at most 8, or while DALI's CPU threads decode (--decode-on "
                   "cpu, or auto before it moves) all of them, a rank's share): what the loader's cost under DDP owes to them")
    p.add_argument('--hw-decoder-load', type=float, default=None, help="the loaders' share of JPEGs for the GPU's hardware "
                   "decoder (default: HW_DECODER_LOAD, 0.65; the rest decode on the SMs, beside the step and NCCL); on 4 "
                   "H100s 0 trained resnet50 faster and 1.0 slower, and 0 trained resnet18 slower (ddp_levers_h100x4_20261127.txt)")
    p.add_argument('--decode-on', default=None, choices=('auto', 'gpu', 'cpu'), help="where the loaders decode JPEGs "
                   "(default: the loaders' 'auto': on DALI's CPU threads until the host waited for them longer than the GPU "
                   "decoder's start costs); 'gpu' from the start; 'cpu' throughout, every core a rank's share of them unless --num-threads")
    p.add_argument('--no-kept-decoder', action='store_true', help="no decoder kept beside the pipelines (`keep_decoder`), "
                   "on one GPU too: under DDP the loaders keep none since 2026-11-27, so this changes only the 1-GPU case")
    p.add_argument('--no-priority-stream', action='store_true', help="the loaders leave PyTorch's work on the caller's "
                   "stream (priority_stream=False): what their high-priority stream is worth")
    p.add_argument('--broadcast-buffers', action='store_true', help="FastStep cases: DDP sends rank 0's BatchNorm statistics "
                   "at every forward (its default), not only before validation (FastStep's)")
    p.add_argument('--no-bucket-view', action='store_true', help="FastStep cases: FastStep(bucket_view=False), DDP built with its "
                   "default, each gradient copied back from DDP's bucket after the all-reduce (FastStep's default: views, no copy)")
    p.add_argument('--model-graph', action='store_true', help="FastStep cases: FastStep(whole_step=False), the model's forward and "
                   "backward captured alone (DDP's hooks all-reduce uncaptured), as before 2026-11-29; else the step is one graph where it can be")
    p.add_argument('--decoder-cost', type=float, default=None, help="decode_on='auto': price the GPU decoder's start at this "
                   "many seconds of the host's waits (default: gpu_decoder_cost's), to see the move and its one-epoch trial in a short run")
    p.add_argument('--every-rank-says', action='store_true', help="FastStep's messages (a capture that failed) from every rank, "
                   "not from the first only, each naming its rank; each inference-forward capture's batch shape, each capture another thread "
                   "broke (tried again), and each run of the garbage collector during a capture: a capture failing on one rank alone is said")
    p.add_argument('--recapture', action='store_true', help="a probe (implies --every-rank-says): every inference forward after a "
                   "shape's first captured anew, each broken capture tried again, and what every other thread does when one fails")
    p.add_argument('--result', default=None, help='rank 0 writes {"img_s": ...} here')
    a = p.parse_args()
    if a.compare:
        if a.recapture: raise SystemExit("--recapture is a probe of one run (its captures slow every validation): run it without --compare")
        most = torch.cuda.device_count() if a.compare == 'max' else int(a.compare)
        if a.n_per_class is None and a.path is None: a.n_per_class = n_per_class_for(a.images_per_rank, most)
        keep = [x for k in ('arch', 'path', 'bs', 'size', 'n_per_class', 'epochs', 'num_threads', 'hw_decoder_load', 'decode_on', 'decoder_cost') if getattr(a, k) is not None
                for x in (f"--{k.replace('_', '-')}", str(getattr(a, k)))] + ['--no-priority-stream']*a.no_priority_stream + ['--broadcast-buffers']*a.broadcast_buffers + ['--no-kept-decoder']*a.no_kept_decoder + ['--no-bucket-view']*a.no_bucket_view + ['--every-rank-says']*a.every_rank_says
        cases = [int(c) for c in a.cases.split(',')] if a.cases else None
        if cases and not all(1 <= c <= len(CASES) for c in cases):
            raise SystemExit(f"--cases {a.cases}: each must be a row of the table, 1 to {len(CASES)}")
        if a.no_bucket_view and not (cases and set(cases) <= set(VIEW_CASES)): raise SystemExit(VIEWS_REFUSED)
        counts = gpu_counts(most) if a.counts is None else sorted({int(c) for c in a.counts.split(',')})
        if not all(1 <= n <= most for n in counts):
            raise SystemExit(f"--counts {a.counts}: each must be 1 to {most}, the GPUs --compare {a.compare} gives")
        out = Path(a.out if not a.no_bucket_view or a.out != OUT else 'ddp_bench_no_bucket_view.json')  # not mixed with FastStep's default's rows
        return compare(counts, keep, a.bs, out, a.fresh, cases, a.arch + (", FastStep's DDP with its default gradients (no bucket views)" if a.no_bucket_view else ''))
    if a.no_bucket_view and (a.synthetic or a.plain_dali or a.loader_only or not (a.fast_step or a.graph or a.auto)): raise SystemExit(VIEWS_REFUSED)
    if a.no_kept_decoder: dali_fastai.loader.keep_decoder = lambda *args: None  # a probe's switch, as tools/session_starts.py's
    if a.decoder_cost is not None: dali_fastai.loader.gpu_decoder_cost = lambda *args: a.decoder_cost  # the move, and its trial, early
    rank, world = int(os.environ.get('RANK', 0)), int(os.environ.get('WORLD_SIZE', 1))
    if a.every_rank_says or a.recapture: every_rank_says(rank)
    if a.recapture: recapture_each(rank)
    torch.cuda.set_device(int(os.environ.get('LOCAL_RANK', 0)))
    path = a.path or bench_images(n_per_class=a.n_per_class or 2000)  # the same folder on every rank (written once, atomically)
    dls = DaliDataLoaders.from_folder(path, valid_pct=0.1, bs=a.bs, size=a.size, seed=0, num_threads=a.num_threads,
                                      priority_stream=not a.no_priority_stream,
                                      **({} if a.hw_decoder_load is None else {'hw_decoder_load': a.hw_decoder_load}),
                                      **({} if a.decode_on is None else {'decode_on': a.decode_on}))
    n_imgs = len(dls.train.shard(rank, world, seed=0))*a.bs  # a rank's training images an epoch, as the fit shards them
    model = f"fastai's {a.arch}" if a.fastai_model else a.arch
    costs,each = {},None  # what the first epoch paid for: seconds of pipeline builds and graph capture, where the case has them
    if a.synthetic:
        times = plain_epochs(a.epochs, synthetic_batches(n_imgs//a.bs, a.bs, a.size), world, a.fastai_model, graph=a.graph, spent=costs, arch=a.arch)
        what = f"{model} bf16, synthetic data, plain DDP{', captured' if a.graph else ''}"
    elif a.plain_dali:
        dl = dls.train.shard(rank, world, seed=0).to(torch.device('cuda', torch.cuda.current_device()))
        times,what = (plain_epochs(a.epochs, lambda: dl, world, a.fastai_model, loader_stream=not a.no_priority_stream, arch=a.arch),
                      f'{model} bf16, dali_fastai shard, plain DDP')
    elif a.loader_only: times,what,costs = loader_epochs(dls.train, a.epochs),'loader only',{'pipeline builds': build_seconds(dls)}
    else:
        graph = 'auto' if a.auto else a.graph
        times,costs,each = fit_epochs(dls, a.epochs, world, a.sync_bn, bar=not a.no_bar, fused=a.fused_adamw, fast_step=a.fast_step or a.auto,
                           graph=graph, arch=a.arch, broadcast_buffers=a.broadcast_buffers, bucket_view=not a.no_bucket_view, whole_step=not a.model_graph)
        what = (f"{a.arch} bf16, fastai + dali_fastai, sync_bn={a.sync_bn}{', no progress bar' if a.no_bar else ''}"
                f"{', fused AdamW' if a.fused_adamw else ''}{f', FastStep(graph={graph!r})' if a.fast_step or a.graph or a.auto else ''}"
                f"{', buffers broadcast each forward' if a.broadcast_buffers else ''}{', DDP default gradients (no bucket views)' if a.no_bucket_view and world > 1 else ''}{', the model alone captured' if a.model_graph else ''}")
    img_s = n_imgs*world*(len(times)-1)/sum(times[1:])
    whole = n_imgs*world*len(times)/sum(times)  # what the user waits for: the first epoch (builds, capture, cuDNN) included
    if a.result and rank == 0: Path(a.result).write_text(json.dumps({'img_s': img_s, 'whole_img_s': whole}))
    print(f"ddp_bench rank {rank}: {world} GPU(s), {what}, bs {a.bs}/GPU, {n_imgs} images/rank/epoch, epochs 2..{a.epochs}: "
          f"{img_s:,.0f} img/s all ranks; all {len(times)} epochs: {whole:,.0f} img/s (epoch times "
          f"{', '.join(f'{t:.2f}' for t in times)} s){paid(costs, loader_builds(dls))}{decoding(dls.train, each)}", flush=True)


if __name__ == '__main__': main()
