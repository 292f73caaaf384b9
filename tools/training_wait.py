"""Where a ResNet-18 training step with dali_fastai waits, on the GPU machine, in one run:

    python tools/training_wait.py

1. Each batch timed by a callback that synchronizes the GPU after the step: the loader's hand-over (end of one batch to
   the start of the next) and the synchronized step, with synthetic batches kept on the GPU and with dali_fastai.
2. `training_throughput` with and without fitting on a high-priority CUDA stream (`HighPriority`, below), interleaved
   after a warm-up run, against the synthetic ceiling: the lever the bench notebook's "Second round" reports."""
import statistics, time
import torch, torchvision
from fastai.callback.core import Callback
from fastai.callback.fp16 import AMPMode
from fastai.data.core import DataLoaders
from fastai.learner import Learner
from fastai.losses import CrossEntropyLossFlat

from dali_fastai.bench import bench_images, training_throughput, SyntheticLoader
from dali_fastai.data import DaliDataLoaders


class StepTimes(Callback):
    "Seconds from one batch's end to the next one's start (the loader), and of each step with the GPU synchronized"
    order = 99
    def before_fit(self): self.fetch,self.step,self.t = [],[],None
    def before_batch(self):
        now = time.perf_counter()
        if self.t is not None: self.fetch.append(now - self.t)
        self.t0 = now
    def after_batch(self):
        torch.cuda.synchronize(); now = time.perf_counter(); self.step.append(now - self.t0); self.t = now
    def after_epoch(self): self.t = None


class HighPriority(Callback):
    "Fit on a high-priority CUDA stream, so the GPU schedules the model's kernels ahead of DALI's (a lever under trial)"
    order = -100
    def before_fit(self): self.ctx = torch.cuda.stream(torch.cuda.Stream(priority=-1)); self.ctx.__enter__()
    def after_fit(self): self.ctx.__exit__(None, None, None)


def step_times(dls)->str:
    learn = Learner(dls, torchvision.models.resnet18(num_classes=10), loss_func=CrossEntropyLossFlat())
    learn.to_channelslast(use_amp=True, amp_mode=AMPMode('bf16'))
    cb = StepTimes()
    with learn.no_bar(), learn.no_logging(): learn.fit(2, cbs=cb)
    f,s = statistics.median(cb.fetch[5:]),statistics.median(cb.step[5:])
    return f"hand-over {1e3*f:.2f} ms, synchronized step {1e3*s:.2f} ms"


if __name__ == '__main__':
    import fastai.callback.progress  # noqa: F401 (Learner.no_bar)
    path,synth = bench_images(),SyntheticLoader(256, 224, 10, torch.device('cuda'))
    dls = DaliDataLoaders.from_folder(path, bs=256, size=224, device='gpu', seed=0)
    print('synthetic  ', step_times(DataLoaders(synth, synth)))
    print('dali_fastai', step_times(dls))
    res = {'synthetic ceiling': training_throughput(DataLoaders(synth, synth), 'resnet18', c=10)}
    training_throughput(dls, 'resnet18', c=dls.c)  # warm-up
    for run in (1, 2):
        res[f'dali_fastai, run {run}'] = training_throughput(dls, 'resnet18', c=dls.c)
        res[f'dali_fastai on a high-priority stream, run {run}'] = training_throughput(dls, 'resnet18', c=dls.c, cbs=[HighPriority()])
    c = res['synthetic ceiling']
    for k,v in res.items(): print(f"{k:<46}{v:>8,.0f} img/s {100*v/c:5.1f}%")
