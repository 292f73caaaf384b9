"""Where a FastStep training batch makes the host wait for the GPU (call sites), and its GPU time, for one task of the step bench.

    python tools/step_sites.py [detection|retinanet|segmentation|classification] [--batches 10]

1. One warm-up fit of a few batches (capture, cuDNN's choices, pinned memory), then `--batches` training batches with
   `torch.cuda.set_sync_debug_mode('warn')`: each host sync's call site (the last frames of its Python stack), counted.
   The fit's start and end make a few of their own.
2. A training epoch (no validation) under torch's profiler: the GPU's time a batch, over the batches it trained (its
   kernels and copies, each counted once, the loader's DALI kernels among them) and the ops that take the most of it.
GPU only. Read on an H200 (2026-11-26, the detection task, FCOS at 128 px, bs 64): 4 syncs in the fit, all at its start and
end (the task's epoch has 6 batches); 76.6 ms of GPU time over the 6 training batches, 12.8 ms a batch, as the step
bench's plain loop measures it (13.8 ms). Its first reading (73.3 ms, said to be 6.1 ms a batch) divided by 12 batches
where the epoch had 6 and a validation pass.
"""
import argparse, collections, traceback, warnings


def main(task:str='detection', batches:int=10):
    import torch
    from torch.profiler import profile, ProfilerActivity
    from dali_fastai.stepbench import _task_data, device_ms
    from dali_fastai.data import DaliDataLoaders
    from dali_fastai.measure import STEADY_PACE, Throughput
    from dali_fastai.faststep import FastStep
    from fastai.callback.core import Callback, CancelValidException
    t,src,db = _task_data(task, None, None)
    learn = t.learner(DaliDataLoaders.from_dblock(db, src, bs=64, device='cuda', seed=0, **STEADY_PACE), [FastStep()], metric=False, size=t.size)
    sites = collections.Counter()
    def seen(message, category, filename, lineno, file=None, line=None):
        if 'synchroniz' not in str(message): return
        stack = [f for f in traceback.extract_stack()[:-2] if 'warnings' not in f.filename][-5:]
        sites[' <- '.join(f"{f.filename.split('/')[-1]}:{f.lineno} {f.name}" for f in reversed(stack))] += 1
    with learn.no_bar(), learn.no_logging(), warnings.catch_warnings():
        warnings.showwarning = seen
        warnings.simplefilter('always')
        learn.fit(1, cbs=Throughput(n_batches=3, warmup=2))
        torch.cuda.set_sync_debug_mode('warn')
        try: learn.fit(1, cbs=Throughput(n_batches=batches, warmup=0))
        finally: torch.cuda.set_sync_debug_mode(0)
    print(f"{task}: {sum(sites.values())} host syncs in {batches} training batches and the fit's start and end")
    for k,v in sites.most_common(15): print(f"{v:5d}  {k}")
    class TrainOnly(Callback):
        def before_fit(self): self.n = 0
        def after_batch(self): self.n += 1
        def before_validate(self): raise CancelValidException
    count = TrainOnly()
    with learn.no_bar(), learn.no_logging():
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            learn.fit(1, cbs=count)
            torch.cuda.synchronize()
    gpu = device_ms(prof)
    print(f"GPU time: {gpu:.1f} ms over {count.n} training batches, {gpu/count.n:.1f} ms a batch")
    print(prof.key_averages().table(sort_by='self_device_time_total', row_limit=12, max_name_column_width=60))


if __name__ == '__main__':
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('task', nargs='?', default='detection'); p.add_argument('--batches', type=int, default=10)
    a = p.parse_args()
    main(a.task, a.batches)
