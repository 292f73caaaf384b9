"""What breaks a thread-local CUDA graph capture of a model's inference forward (as `ForwardCapture` captures it): the same
capture, made again and again, beside one kind of other work each, counting the captures that fail by their first error.

    python tools/capture_beside.py [--captures 120] [--cases threads,loaders,freed,after,leaks,peers]

- threads: nothing beside; another thread syncing the device; allocating and freeing pinned memory; allocating and
  freeing device memory (`cudaMalloc`/`cudaFree`); copying to the GPU on its own stream.
- loaders: dali_fastai's training and validation loaders running ahead (DALI's threads), decoding on the CPU and the GPU.
- freed: a DALI pipeline freed during the capture (its last reference dropped; held in a reference cycle and freed by the
  collector, which a forward's allocations run), then the same with the collector off (`_no_collection`). Each case in a
  process of its own: a pipeline freed mid-capture stops the process.
- after (not by default): what a broken capture leaves: the first error of the op that met the break (cuDNN's, cuBLAS's,
  PyTorch's), and whether the next uncaptured op or forward fails; then breaks at a random moment of the model's capture,
  without and with `_capturing`'s `_leftovers_spent`.
- leaks (not by default): the memory captures broken after the forward keep, without and with `_pool_released`.
- peers (not by default; 2 GPUs): rank 1 captures while rank 0 runs NCCL work that rank 1 joins after (each case a
  `torchrun` of 2 processes).

Read on one H200 (2026-11-29, ResNet-50 bf16, bs 64; 32 for the freed pipelines; nbs/images/capture_beside_h200_20261129.txt):
nothing beside, 0 of 120 failed; a thread syncing the device, 120 of 120, each with "operation failed due to a previous
error during capture" first and nothing before it (that thread was told "operation not permitted when stream is
capturing"); pinned memory, device memory, copies on another stream, and the loaders (each way of decoding), 0 of 120
each. A DALI pipeline freed mid-capture, either way, stopped the process (DALI's CUDAError, "operation not permitted when
stream is capturing"); with the collector off, 0 of 20 failed.
Read on one H200 and two (2026-11-29, evening; nbs/images/capture_broken_h200_20261129.txt): of 400 breaks at a random
moment, 259 failed, 25 of them met first by cuDNN, and after 10 of those the model's next uncaptured forward failed once
with CUDNN_STATUS_EXECUTION_FAILED_CUDART; with `_leftovers_spent`, none of 400 more. 40 captures broken after the forward
kept 4,804 MiB, which `empty_cache` did not give back; 0 MiB with `_pool_released`. Beside the other rank's NCCL work
(all-gathers of old and new sizes, a new communicator's first collectives, this rank's own all-reduce pending): 0 of 260
captures failed; beside each of the 4 loaders running ahead, 0 of 500 (`--cases loaders --captures 500`). GPU only.
"""
import argparse, collections, contextlib, gc, random, subprocess, sys, threading, time

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


def broken_then(model, x, n:int=5):
    """What a capture another thread broke leaves behind: a thread syncs the device inside the capture, then one op (cuDNN's
    convolution, cuBLAS's matmul, PyTorch's own kernel) runs in it; the error that op raised, then whether each kind of op
    fails once uncaptured after it, twice in a row (a library's CUDA error left set would fail its next launch)"""
    import torch.nn.functional as F
    from dali_fastai.capture import _rng_out_of_capture
    dev = x.device
    w,a = torch.randn(8, 3, 3, 3, device=dev),torch.randn(64, 64, device=dev)
    ops = {'conv (cuDNN)': lambda: F.conv2d(x[:2], w), 'matmul (cuBLAS)': lambda: a @ a, 'add (PyTorch)': lambda: a + 1,
           'the model': lambda: model(x)}
    def tried(f)->str:
        try: f(); torch.cuda.synchronize(); return 'ok'
        except Exception as e: return first_error(e)
    for name,op in list(ops.items())[:3]:
        for then,f in ops.items():
            said = collections.Counter()
            for _ in range(n):
                stream,g,inside = torch.cuda.current_stream(),torch.cuda.CUDAGraph(),[]
                try:
                    with torch.no_grad(), torch.cuda.graph(g, capture_error_mode='thread_local'):
                        t = threading.Thread(target=lambda: tried(torch.cuda.synchronize)); t.start(); t.join()
                        try: op()
                        except Exception as e: inside.append(first_error(e)); raise
                except Exception as e: inside.append('ended: ' + first_error(e))
                torch.cuda.set_stream(stream); _rng_out_of_capture(dev)
                with torch.no_grad(): said[f"{'; '.join(inside)} || then {then}: {tried(f)}, again: {tried(f)}"] += 1
            for k,v in said.items(): print(f"broken, {name} inside: {v} of {n}: {k}", flush=True)

    # the break at a random moment of the model's capture: inside any of its ops, cuDNN's and cuBLAS's included; then the
    # model uncaptured, as it is and after `_capturing`'s `_leftovers_spent`
    from dali_fastai.capture import _leftovers_spent
    xb = x.to(memory_format=torch.channels_last)
    for spent in (False, True):
        said,rng,failed = collections.Counter(),random.Random(0),0
        for _ in range(n*80):
            stream,g,inside = torch.cuda.current_stream(),torch.cuda.CUDAGraph(),[]
            delay = rng.uniform(0, 0.008)
            try:
                with torch.no_grad(), torch.autocast('cuda', dtype=torch.bfloat16, cache_enabled=False):
                    with torch.cuda.graph(g, capture_error_mode='thread_local'):
                        t = threading.Thread(target=lambda: (time.sleep(delay), tried(torch.cuda.synchronize))); t.start()
                        try: model(xb)
                        except Exception as e: inside.append(first_error(e)); raise
            except Exception as e: failed += 1
            t.join(); torch.cuda.set_stream(stream); _rng_out_of_capture(dev)
            if inside and spent: _leftovers_spent(dev)
            with torch.no_grad(), torch.autocast('cuda', dtype=torch.bfloat16):
                said[f"{inside[0] if inside else 'no op failed'} || then the model: {tried(lambda: model(xb))}, again: {tried(lambda: model(xb))}"] += 1
        print(f"broken at a random moment of the model's bf16 capture{', then _leftovers_spent' if spent else ''}: {failed} of {n*80} failed", flush=True)
        for k,v in said.most_common(): print(f"  {v}: {k}", flush=True)


def leaks(model, x, n:int=40):
    """The memory a failed capture keeps: `n` captures of the model's forward, each broken after it (another thread syncs the
    device), the allocator's reserved memory after them and after `empty_cache`, without and with `_pool_released`"""
    from dali_fastai.capture import _rng_out_of_capture, _pool_released
    dev,xb = x.device,x.to(memory_format=torch.channels_last)
    def sync():
        try: torch.cuda.synchronize()
        except RuntimeError: pass
    for released in (False, True):
        torch.cuda.synchronize(); torch.cuda.empty_cache(); before,failed = torch.cuda.memory_reserved(dev),0
        for _ in range(n):
            stream,g,pool = torch.cuda.current_stream(),torch.cuda.CUDAGraph(),torch.cuda.graph_pool_handle()
            try:
                with torch.no_grad(), torch.autocast('cuda', dtype=torch.bfloat16, cache_enabled=False):
                    with torch.cuda.graph(g, pool=pool, capture_error_mode='thread_local'):
                        model(xb); t = threading.Thread(target=sync); t.start(); t.join()
            except Exception: failed += 1
            torch.cuda.set_stream(stream); _rng_out_of_capture(dev)
            if released: _pool_released(pool, dev)
            del g
        kept = torch.cuda.memory_reserved(dev) - before
        torch.cuda.empty_cache()
        print(f"{n} captures broken after the forward{', each pool released' if released else ''}: {failed} failed; reserved "
              f"{kept/2**20:,.0f} MiB more, {(torch.cuda.memory_reserved(dev) - before)/2**20:,.0f} MiB after empty_cache", flush=True)


PEERS = ('2 processes, no collective',
         'the peer all-gathering while this rank captures (the batch sizes it had before)',
         'the peer all-gathering a new size each time',
         "the peer's first collectives on a new communicator (its connections made lazily)",
         "this rank's own all-reduce still waiting for the peer when the capture begins")

def peers(model, x, case:int, n:int):
    "One of `PEERS`, in a process of two (`torchrun`): rank 1 captures, then joins what rank 0 started meanwhile (the other rank of a DDP validation, ahead)"
    import random, torch.distributed as dist
    from dali_fastai.distributed import gather_batches
    rank,dev = dist.get_rank(),x.device
    fails,t,n = collections.Counter(),time.perf_counter(),min(n, 20) if case == 3 else n  # a communicator takes a while to make
    def joined(i, bs, g=None):
        "What both ranks run once rank 1's capture is over"
        if case in (1, 2): gather_batches(torch.randn(bs, 10, device=dev))
        if case == 3:
            parts = [torch.empty(1 << 22, device=dev) for _ in range(2)]
            dist.all_gather(parts, torch.ones(1 << 22, device=dev), group=g)
            buf = torch.ones(1 << 20, device=dev)
            (dist.send if rank == 0 else dist.recv)(buf, 1 - rank, group=g)
    for i in range(n):
        bs = 64 - (i % 48) if case == 2 else 64
        g = dist.new_group([0, 1]) if case == 3 else None
        if g is not None: dist.barrier(group=g, device_ids=[dev.index])  # the communicator made, its small-message connection too
        dist.barrier(device_ids=[dev.index]); torch.cuda.synchronize()
        if rank == 0:
            if case == 4: time.sleep(0.05); dist.all_reduce(torch.ones(1 << 24, device=dev))
            else: joined(i, bs, g)
        else:
            xs = x[:bs]
            with torch.no_grad(), torch.autocast('cuda', dtype=torch.bfloat16): model(xs)
            if case == 4: dist.all_reduce(torch.ones(1 << 24, device=dev))  # left waiting for rank 0, which sleeps first
            err = capture(model, xs, collector_off=True)
            if err is not None: fails[err] += 1
            if case != 4: joined(i, bs, g)
        torch.cuda.synchronize()
        if g is not None: dist.destroy_process_group(g)
    if rank == 1: print(f"{PEERS[case]}: {n} captures, {sum(fails.values())} failed, {time.perf_counter() - t:.1f} s {dict(fails)}", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--captures', type=int, default=120); p.add_argument('--cases', default='threads,loaders,freed')
    p.add_argument('--freed-case', type=int, default=None, help=argparse.SUPPRESS)  # one `FREED` case, in its own process
    p.add_argument('--peer-case', type=int, default=None, help=argparse.SUPPRESS)  # one `PEERS` case, in a process of two
    a = p.parse_args()
    if not torch.cuda.is_available(): raise SystemExit("capture_beside.py captures CUDA graphs: it needs a CUDA GPU")
    if a.peer_case is not None:
        import os, torch.distributed as dist
        torch.cuda.set_device(int(os.environ['LOCAL_RANK']))
        dist.init_process_group('nccl', device_id=torch.device('cuda', torch.cuda.current_device()))
    from torchvision.models import resnet50
    torch.backends.cudnn.benchmark = True
    model = resnet50(num_classes=10).cuda().to(memory_format=torch.channels_last).eval()
    x = torch.randn(64, 3, 224, 224, device='cuda')
    if a.freed_case is not None: return freed(model, x[:32], a.freed_case)
    if a.peer_case is not None: return peers(model, x, a.peer_case, min(a.captures, 60))
    cases = a.cases.split(',')
    if 'leaks' in cases: leaks(model, x)
    if 'after' in cases: broken_then(model, x)
    if 'threads' in cases: threads(model, x, a.captures)
    if 'loaders' in cases: loaders(model, a.captures)
    if 'freed' in cases:
        for i,name in enumerate(FREED):
            r = subprocess.run([sys.executable, __file__, '--freed-case', str(i)], capture_output=True, text=True)
            if r.returncode: print(f"{name}: the process stopped (exit {r.returncode}): "
                                   f"{' '.join(l.strip() for l in r.stderr.splitlines() if 'what()' in l or 'not permitted' in l)[:200]}", flush=True)
            else: print(r.stdout.strip(), flush=True)
    if 'peers' in cases:
        for i,name in enumerate(PEERS if torch.cuda.device_count() >= 2 else ()):
            r = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node', '2', __file__,
                                '--peer-case', str(i), '--captures', str(a.captures)], capture_output=True, text=True)
            print(r.stdout.strip() if r.returncode == 0 else f"{name}: the processes stopped (exit {r.returncode}): {r.stderr[-600:]}", flush=True)


if __name__ == '__main__': main()
