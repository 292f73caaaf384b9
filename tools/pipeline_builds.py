"""What building DALI pipelines costs a short fit, and whether a build in the background slows the training beside it.

    python tools/pipeline_builds.py [--device cuda] [--steps 30]

On the bench's classification task (`bench_images(n_per_class=500)`, 224 px, bs 64, ResNet-18 in bf16, channels_last):
1. the training and then the validation pipeline built in the foreground, each timed;
2. `steps` training steps alone, then the same steps while the validation loader's `prepare()` builds its pipeline in a
   background thread (what `DaliDataLoaders` does when a training epoch starts): the steps' seconds side by side, and when
   the build had finished.
Read on an H200 (2026-11-26): training build 2.22 s when no other pipeline is alive (nvImageCodec's nvjpeg extension
starting: tools/decoder_start.py), validation build 0.47 s beside it; 30 steps 0.43 s alone and 1.00 s with the validation
build in the background, the build joined at the end: the build does not overlap the steps, it holds them up for about
its own length. (A first reading, 2.98 s against 2.88 s, timed steps that reset the training loader mid-epoch, which
closed its pipeline.)
"""
import argparse, threading, time, warnings


def main(device:str='cuda', steps:int=30):
    warnings.filterwarnings('ignore')
    import torch
    from dali_fastai.stepbench import _task_data
    from dali_fastai.data import DaliDataLoaders
    from dali_fastai.measure import _endless
    sync = torch.cuda.synchronize if device.startswith('cuda') else (lambda: None)
    def now(): sync(); return time.perf_counter()
    t,src,db = _task_data('classification', None, None)
    dls = DaliDataLoaders.from_dblock(db, src, bs=64, device=device, seed=0)
    a = now(); dls.train._iterator(); b = now(); dls.valid._iterator(); c = now()
    print(f"training pipeline build {b-a:.3f} s (none other alive), validation pipeline build {c-b:.3f} s (beside it)")
    learn = t.learner(dls, [], metric=False)
    m = learn.model.to(device).to(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(m.parameters())
    batches = _endless(dls.train) # epoch after epoch, the training pipeline alive throughout (as in a fit)
    def run(n:int):
        for _ in range(n):
            x,y = next(batches)
            with torch.autocast(device.split(':')[0], dtype=torch.bfloat16): loss = learn.loss_func(m(x), y)
            loss.backward(); opt.step(); opt.zero_grad()
    run(10); s = now(); run(steps); alone = now() - s
    dls.valid.close()
    s = now(); dls.valid.prepare(); run(steps); beside = now() - s
    dls.valid._source._join(); done = now() - s
    print(f"{steps} steps alone {alone:.3f} s; with the validation pipeline built in the background {beside:.3f} s "
          f"(the build joined at {done:.3f} s)")


if __name__ == '__main__':
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--device', default='cuda'); p.add_argument('--steps', type=int, default=30)
    a = p.parse_args()
    main(a.device, a.steps)
