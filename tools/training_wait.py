"""Where a training step with dali_fastai waits, on the GPU machine, in one run:

    python tools/training_wait.py [--arch resnet18] [--levers hw_decoder_load=1.0 num_threads=4 decode_on=cpu ...]

1. Step times, training batches only (validation batches are forward-only and would pull the median down): the
   loader's hand-over (end of one batch to the start of the next) and the step with the GPU synchronized after it, with
   synthetic batches kept on the GPU and with dali_fastai.
2. GPU kernel time a training batch, from the PyTorch profiler, by CUDA stream: the model's kernels run on PyTorch's
   stream, DALI's on its own. Kernel time DALI spends on the SMs while the model trains is time the model's kernels
   share them: the loader's cost to training, however fast the loader alone is. The busiest kernels of each stream are
   named.
3. Loader alone, each setting side by side (`side_by_side`): what a setting costs or gives a loader that has the
   GPU to itself.
4. `training_throughput` for each setting (`--levers`, each `name=value` for `DaliDataLoaders.from_folder`), taken in
   turn twice after a warm-up run, against the synthetic ceiling."""
import argparse, collections, statistics, time
import torch
from torch.profiler import profile, ProfilerActivity
from fastai.callback.core import Callback, CancelFitException
from fastai.data.core import DataLoaders

from dali_fastai.measure import STEADY_PACE, bench_images, training_throughput, throughput_learner, side_by_side, SyntheticLoader
from dali_fastai.data import DaliDataLoaders


class StepTimes(Callback):
    "Seconds from one training batch's end to the next one's start (the loader), and of each step with the GPU synchronized"
    order = 99
    def before_fit(self): self.fetch,self.step,self.t = [],[],None
    def before_batch(self):
        if not self.training: return
        now = time.perf_counter()
        if self.t is not None: self.fetch.append(now - self.t)
        self.t0 = now
    def after_batch(self):
        if not self.training: return
        torch.cuda.synchronize(); now = time.perf_counter(); self.step.append(now - self.t0); self.t = now
    def after_epoch(self): self.t = None


class Profile(Callback):
    "Profile `n` training batches after `warmup`, then cancel the fit"
    order = 99
    def __init__(self, n:int=20, warmup:int=10): self.n,self.warmup,self.seen,self.prof = n,warmup,0,None
    def before_batch(self):
        if self.training and self.seen == self.warmup:
            torch.cuda.synchronize(); self.prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]); self.prof.__enter__()
    def after_batch(self):
        if not self.training: return
        self.seen += 1
        if self.seen == self.warmup + self.n:
            torch.cuda.synchronize(); self.prof.__exit__(None, None, None)
            raise CancelFitException()


def step_times(dls, arch:str)->str:
    learn,cb = throughput_learner(dls, arch, dls.c),StepTimes()
    with learn.no_bar(), learn.no_logging(): learn.fit(2, cbs=cb)
    f,s = statistics.median(cb.fetch[5:]),statistics.median(cb.step[5:])
    return f"hand-over {1e3*f:.2f} ms, synchronized step {1e3*s:.2f} ms ({dls.bs/(f+s):,.0f} img/s)"


def kernel_time(dls, arch:str, n:int=20)->str:
    "GPU kernel milliseconds a training batch, by stream, with each stream's busiest kernels"
    learn,cb = throughput_learner(dls, arch, dls.c),Profile(n)
    with learn.no_bar(), learn.no_logging(): learn.fit(100, cbs=cb)
    by_stream,names = collections.Counter(),collections.defaultdict(collections.Counter)
    for e in cb.prof.events():  # the profiler's public events (its kineto results were emptied on exit from torch 2.11 on)
        if e.device_type != torch.autograd.DeviceType.CUDA: continue
        ms = e.time_range.elapsed_us()/1e3/n
        by_stream[e.device_resource_id] += ms; names[e.device_resource_id][e.name[:90]] += ms
    lines = []
    for s,ms in by_stream.most_common():
        top = '; '.join(f"{k} {v:.2f}" for k,v in names[s].most_common(3))
        lines.append(f"    stream {s}: {ms:7.2f} ms a batch  [{top}]")
    return '\n'.join(lines)


def _value(v:str):
    "A lever's value as the loader takes it: an int, a float, or the word itself ('float16', 'cpu')"
    for kind in (int, float):
        try: return kind(v)
        except ValueError: pass
    return v

def parse_levers(levers:list)->dict:
    "`['hw_decoder_load=1.0', 'num_threads=4', 'decode_on=cpu']` -> `{'hw_decoder_load=1.0': {...}, ...}`; '' is the defaults (`STEADY_PACE`: the GPU pipeline's steady pace)"
    res = {}
    for lever in levers:
        kw = {}
        for item in filter(None, lever.split(',')):
            k,v = item.split('=')
            kw[k] = _value(v)
        res[lever or 'defaults'] = kw
    return res


if __name__ == '__main__':
    import fastai.callback.progress  # noqa: F401 (Learner.no_bar)
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--arch', default='resnet18')
    p.add_argument('--levers', nargs='*', default=['', 'hw_decoder_load=1.0'])
    p.add_argument('--profile', nargs='*', default=['', 'hw_decoder_load=1.0'], help="levers to profile")
    a = p.parse_args()
    path,synth = bench_images(),SyntheticLoader(256, 224, 10, torch.device('cuda'))
    make = lambda kw: DaliDataLoaders.from_folder(path, bs=256, size=224, device='gpu', seed=0, **{**STEADY_PACE, **kw})
    sdls = DataLoaders(synth, synth); sdls.c = 10
    print(f"== {torch.cuda.get_device_name()} | {a.arch}, bs 256, 224 px, bf16, channels_last", flush=True)
    print('== 1. step times (training batches)')
    print(f"  synthetic   {step_times(sdls, a.arch)}")
    for name,kw in parse_levers(a.profile).items(): print(f"  {name:<11} {step_times(make(kw), a.arch)}", flush=True)
    print('== 2. GPU kernel time a training batch, by CUDA stream (PyTorch profiler)')
    print(f"  synthetic\n{kernel_time(sdls, a.arch)}", flush=True)
    for name,kw in parse_levers(a.profile).items(): print(f"  {name}\n{kernel_time(make(kw), a.arch)}", flush=True)
    dls = {name: make(kw) for name,kw in parse_levers(a.levers).items()}
    print('== 3. loader alone, side by side')
    for name,v in side_by_side({k: d.train for k,d in dls.items()}, torch.device('cuda')).items(): print(f"  {name:<40}{v:>8,.0f} img/s")
    print('== 4. training_throughput, levers taken in turn (run 1, run 2)', flush=True)
    ceil = training_throughput(sdls, a.arch, c=10)
    training_throughput(next(iter(dls.values())), a.arch, c=10)  # warm-up
    rates = collections.defaultdict(list)
    for run in (1, 2):
        for name,d in dls.items(): rates[name].append(training_throughput(d, a.arch, c=d.c))
    print(f"  {'synthetic ceiling':<40}{ceil:>8,.0f} img/s")
    for name,r in rates.items(): print(f"  {name:<40}" + '  '.join(f"{v:>7,.0f} ({100*v/ceil:4.1f}%)" for v in r))
