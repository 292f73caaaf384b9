"""What breaks a thread-local CUDA graph capture of a model's inference forward (as `ForwardCapture` captures it): the same
capture, made again and again, beside one kind of other work each, counting the captures that fail by their first error.

    python tools/capture_beside.py [--captures 120] [--cases threads,loaders,freed]

- threads: nothing beside; another thread syncing the device; allocating and freeing pinned memory; allocating and
  freeing device memory (`cudaMalloc`/`cudaFree`); copying to the GPU on its own stream.
- loaders: dali_fastai's training and validation loaders running ahead (DALI's threads), decoding on the CPU and the GPU.
- freed: a DALI pipeline freed during the capture (its last reference dropped; held in a reference cycle and freed by the
  collector, which a forward's allocations run), then the same with the collector off (`_no_collection`). Each case in a
  process of its own: a pipeline freed mid-capture stops the process.

Read on one H200 (2026-11-29, ResNet-50 bf16, bs 64; 32 for the freed pipelines; nbs/images/capture_beside_h200_20261129.txt):
nothing beside, 0 of 120 failed; a thread syncing the device, 120 of 120, each with "operation failed due to a previous
error during capture" first and nothing before it (that thread was told "operation not permitted when stream is
capturing"); pinned memory, device memory, copies on another stream, and the loaders (each way of decoding), 0 of 120
each. A DALI pipeline freed mid-capture, either way, stopped the process (DALI's CUDAError, "operation not permitted when
stream is capturing"); with the collector off, 0 of 20 failed. GPU only.
"""
import argparse, collections, contextlib, gc, subprocess, sys, threading, time

import torch


def first_error(e:BaseException)->str:
    "The error that broke a capture (what the rest were raised while handling), by its type and first line"
    from dali_fastai.capture import _chain
    e = _chain(e)[-1]
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:90]}"


def capture(model, x, during=lambda: None, collector_off:bool=False)->str|None:
    "One thread-local capture of `model`'s bf16 inference forward of `x`, `during` called inside it; None, or its first error"
    from dali_fastai.capture import _no_collection
    from dali_fastai.epoch import gpu_libraries_started, reads_ahead_done
    gpu_libraries_started(); reads_ahead_done()
    stream,static,g = torch.cuda.current_stream(),x.clone(),torch.cuda.CUDAGraph()
    try:
        with _no_collection() if collector_off else contextlib.nullcontext(), torch.no_grad(), \
             torch.autocast('cuda', dtype=torch.bfloat16, cache_enabled=False):
            with torch.cuda.graph(g, capture_error_mode='thread_local'):
                during(); model(static)
        g.replay(); torch.cuda.synchronize()
    except Exception as e:
        torch.cuda.set_stream(stream); return first_error(e)


def count(name:str, model, batches, n:int, **kw):
    "Capture after each of `n` batches of `batches()` (each run uncaptured first: cuDNN's choices); print the failures by first error"
    fails,t = collections.Counter(),time.perf_counter()
    for i,x in zip(range(n), batches()):
        x = x.as_subclass(torch.Tensor).contiguous(memory_format=torch.channels_last)
        try:
            with torch.no_grad(), torch.autocast('cuda', dtype=torch.bfloat16): model(x)
        except Exception as e: fails['uncaptured: ' + first_error(e)] += 1; continue
        if (err := capture(model, x, **kw)) is not None: fails[err] += 1
    print(f"{name}: {n} captures, {sum(fails.values())} failed, {time.perf_counter() - t:.1f} s {dict(fails)}", flush=True)


def beside(f):
    "Run `f` in a loop on another thread until the returned event is set (what it raises is counted)"
    stop,said = threading.Event(),collections.Counter()
    def loop():
        while not stop.is_set():
            try: f()
            except Exception as e: said[first_error(e)] += 1
    threading.Thread(target=loop, daemon=True).start()
    return stop,said


def threads(model, x, n:int):
    count('nothing beside', model, lambda: iter(lambda: x, None), n)
    dev = x.device
    for name,f in [('a thread syncing the device', torch.cuda.synchronize),
                   ('a thread allocating and freeing pinned memory', lambda: (torch.empty(1 << 22, pin_memory=True), torch._C._host_emptyCache())),
                   ('a thread allocating and freeing device memory', lambda: (torch.empty(1 << 26, device=dev), torch.cuda.empty_cache())),
                   ('a thread copying to the GPU on its own stream', lambda: torch.ones(1 << 20, pin_memory=True).to(dev, non_blocking=True))]:
        stop,said = beside(f)
        count(name, model, lambda: iter(lambda: x, None), n); stop.set(); time.sleep(0.2)
        if said: print(f"  that thread was told: {dict(said)}", flush=True)


def loaders(model, n:int):
    from dali_fastai.measure import bench_images
    from dali_fastai.data import DaliDataLoaders
    path = bench_images(n_per_class=400)
    for decode in ('cpu', 'gpu'):
        dls = DaliDataLoaders.from_folder(path, valid_pct=0.1, bs=64, size=224, seed=0, decode_on=decode)
        for name,dl in (('training', dls.train), ('validation', dls.valid)):
            def batches(dl=dl):
                while True: yield from (xb for xb,_ in dl)
            count(f"the {name} loader's DALI pipeline running ahead (decode_on={decode!r})", model, batches, n)


FREED = ('a built DALI pipeline freed (its last reference dropped)',
         'a built DALI pipeline in a reference cycle, the collector run by allocations',
         'the same, the collector off (`_no_collection`)')

def freed(model, x, case:int, n:int=20):
    "One of `FREED`: a small GPU pipeline built and run before each capture, let go of during it"
    from nvidia.dali import fn, pipeline_def
    @pipeline_def(batch_size=8, num_threads=2, device_id=torch.cuda.current_device())
    def small(): return fn.random.uniform(shape=[1 << 16]).gpu()*2
    class Cycle:
        def __init__(self, p): self.p,self.me = p,self
    held = {}
    during = (lambda: held.clear()) if case == 0 else (lambda: [[] for _ in range(20_000)])
    def batches():
        while True:
            p = small(); p.build(); p.run(); torch.cuda.synchronize()
            gc.collect()
            if case == 0: held['p'] = p
            else: Cycle(p)
            del p
            yield x
    count(FREED[case], model, batches, n, during=during, collector_off=case == 2)


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--captures', type=int, default=120); p.add_argument('--cases', default='threads,loaders,freed')
    p.add_argument('--freed-case', type=int, default=None, help=argparse.SUPPRESS)  # one `FREED` case, in its own process
    a = p.parse_args()
    if not torch.cuda.is_available(): raise SystemExit("capture_beside.py captures CUDA graphs: it needs a CUDA GPU")
    from torchvision.models import resnet50
    torch.backends.cudnn.benchmark = True
    model = resnet50(num_classes=10).cuda().to(memory_format=torch.channels_last).eval()
    x = torch.randn(64, 3, 224, 224, device='cuda')
    if a.freed_case is not None: return freed(model, x[:32], a.freed_case)
    cases = a.cases.split(',')
    if 'threads' in cases: threads(model, x, a.captures)
    if 'loaders' in cases: loaders(model, a.captures)
    if 'freed' in cases:
        for i,name in enumerate(FREED):
            r = subprocess.run([sys.executable, __file__, '--freed-case', str(i)], capture_output=True, text=True)
            if r.returncode: print(f"{name}: the process stopped (exit {r.returncode}): "
                                   f"{' '.join(l.strip() for l in r.stderr.splitlines() if 'what()' in l or 'not permitted' in l)[:200]}", flush=True)
            else: print(r.stdout.strip(), flush=True)


if __name__ == '__main__': main()
