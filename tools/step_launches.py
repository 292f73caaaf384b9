"""What an uncaptured training step's host does, for one task of the step bench: its wall time against the training
thread's CPU time, and the CUDA runtime calls and aten ops it makes, from the PyTorch profiler.

    python tools/step_launches.py [detection|retinanet|segmentation|classification] [--steps 10] [--skip 8]

`fit` with `FastStep()` (no graph) and validation skipped, the task's bench DataBlock through `DaliDataLoaders.from_dblock`
at bs 64; after `--skip` training batches, `--steps` batches are profiled (the profiler slows them). The training thread's
CPU time (`time.thread_time`, what the step bench's `HostClock` reads) leaves out the backward: PyTorch runs a CUDA
backward on its own thread per device while the training thread waits. GPU only. Read on an H200 (2026-11-26, FCOS at
128 px): a step 54.3 ms wall under the profiler, the training thread's CPU 27.6 ms, 1,418 `cudaLaunchKernel` + 277
`cudaLaunchKernelExC` + 40 cooperative launches a step; `aten::convolution_backward` 83 calls a step. ResNet-18 at
224 px (`classification`): 19.9 ms, 9.0 ms, 416 `cudaLaunchKernel` a step.
"""
import argparse, statistics, time, warnings


def profile_steps(task:str='detection', steps:int=10, skip:int=8):
    import torch
    from torch.profiler import profile, ProfilerActivity
    from fastai.callback.core import Callback, CancelFitException, CancelValidException
    from dali_fastai.stepbench import _task_data
    from dali_fastai.data import DaliDataLoaders
    from dali_fastai.measure import STEADY_PACE
    from dali_fastai.faststep import FastStep

    class Profiled(Callback):
        "Profile training batches `skip` to `skip+steps`, then stop the fit"
        order = 99
        def __init__(self): self.seen,self.wall,self.cpu = 0,[],[]
        def before_validate(self): raise CancelValidException() # training batches only
        def before_batch(self):
            self.t0,self.c0 = time.perf_counter(),time.thread_time()
            if self.seen == skip:
                torch.cuda.synchronize(); self.prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
                self.prof.__enter__()
        def after_batch(self):
            self.seen += 1
            if self.seen > skip: self.wall.append(time.perf_counter() - self.t0); self.cpu.append(time.thread_time() - self.c0)
            if self.seen == skip + steps:
                torch.cuda.synchronize(); self.prof.__exit__(None, None, None); raise CancelFitException()

    t,src,db = _task_data(task, None, None)
    dls = DaliDataLoaders.from_dblock(db, src, bs=64, device='cuda', seed=0, **STEADY_PACE)
    learn = t.learner(dls, [FastStep(), p := Profiled()], metric=False, size=t.size)
    with learn.no_bar(), learn.no_logging(): learn.fit(-(-(skip + steps) // len(dls.train)) + 1, t.lr)
    ev = p.prof.key_averages()
    print(f"{task}, {steps} training steps profiled: wall median {1e3*statistics.median(p.wall):.1f} ms, "
          f"the training thread's CPU median {1e3*statistics.median(p.cpu):.1f} ms")
    for e in sorted([e for e in ev if e.key.startswith('cu')], key=lambda e: -e.cpu_time_total)[:10]:
        print(f"  {e.key:<36} {e.count/steps:8.1f} calls a step, host {e.cpu_time_total/1e3/steps:6.2f} ms a step")
    for e in sorted([e for e in ev if not e.key.startswith('cu')], key=lambda e: -e.self_cpu_time_total)[:12]:
        print(f"  {e.key[:50]:<50} {e.count/steps:8.1f} calls a step, self host {e.self_cpu_time_total/1e3/steps:6.2f} ms a step")


if __name__ == '__main__':
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('task', nargs='?', default='detection')
    ap.add_argument('--steps', type=int, default=10); ap.add_argument('--skip', type=int, default=8)
    a = ap.parse_args()
    warnings.filterwarnings('ignore')
    profile_steps(a.task, a.steps, a.skip)
