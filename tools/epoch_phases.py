"""Where a short fit's epochs go: training, the validation batches' forward, COCO's evaluation, for one task of the step bench.

    python tools/epoch_phases.py [detection|retinanet] [--epochs 4]

`fit_one_cycle(epochs)` from scratch with `FastStep(graph=True)` and then with `FastStep()`, the same seed, and a callback
that waits for the GPU at each phase's ends (so the phases add up; the fit is slower than an unwatched one): seconds in all
of training, of the validation batches' forward and of the whole batches, of `DetectionMAP`'s evaluation, of validation
and of the epochs, with the last epoch's recorded values. GPU only. Read on an H200 (2026-11-26, FCOS at 128 px, bs 64,
the task's 6 training and 2 validation batches an epoch, 4 epochs, after validation took one forward): graph: training
4.14 s, validation forward 0.47 s, COCO evaluation 1.33 s, epochs 6.18 s; uncaptured: 3.65, 0.30, 1.33, 5.45. At commit
797fef7 (two forwards and torchvision's per-image postprocessing): validation forward 1.40-1.41 s.
"""
import argparse, time, warnings


def main(task:str='detection', epochs:int=4):
    warnings.filterwarnings('ignore')
    import torch
    from fastai.vision.all import Callback, set_seed
    from dali_fastai.stepbench import _task_data
    from dali_fastai.data import DaliDataLoaders
    from dali_fastai.measure import STEADY_PACE
    from dali_fastai.faststep import FastStep
    from dali_fastai.detection import DetectionMAP
    t,src,db = _task_data(task, None, None)
    spent = {}
    def add(k, v): spent[k] = spent.get(k, 0) + v
    def now(): torch.cuda.synchronize(); return time.perf_counter()
    class Phases(Callback):
        order = 99
        def before_train(self): self.t0 = now()
        def after_train(self): add('training', now() - self.t0)
        def before_validate(self): self.t1 = now()
        def before_batch(self): self.tb = now()
        def after_pred(self):
            if not self.training: add('validation forward', now() - self.tb)
        def after_batch(self):
            if not self.training: add('validation batches', now() - self.tb)
        def after_validate(self): add('validation', now() - self.t1)
        def after_epoch(self): add('epochs', now() - self.t0)
    class Timed(DetectionMAP): # the evaluation's seconds: the metrics `detection_learner` makes, timed
        def numbers(self):
            if self.of is not None: return super().numbers() # the other's, timed there
            a = time.perf_counter(); r = super().numbers(); add('COCO evaluation', time.perf_counter() - a); return r
    for graph in (True, False):
        set_seed(0); spent.clear()
        dls = DaliDataLoaders.from_dblock(db, src, bs=64, device='cuda', seed=0, **STEADY_PACE)
        learn = t.learner(dls, [FastStep(graph=graph), Phases()], metric=True, size=t.size)
        learn.metrics = [m := Timed(), Timed('map_50', of=m)]
        with learn.no_bar(), learn.no_logging(): learn.fit_one_cycle(epochs, t.lr)
        print(f"graph={graph}: {epochs} epochs of {len(dls.train)} training and {len(dls.valid)} validation batches; seconds in all: "
              + ', '.join(f'{k} {v:.2f}' for k,v in spent.items()) + f"; last values {[round(v, 4) for v in learn.recorder.values[-1]]}")
        dls.train.close(); dls.valid.close()


if __name__ == '__main__':
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('task', nargs='?', default='detection'); p.add_argument('--epochs', type=int, default=4)
    a = p.parse_args()
    main(a.task, a.epochs)
