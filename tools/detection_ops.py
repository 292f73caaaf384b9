"""How much work a detector's training step asks of PyTorch: the aten ops one step of `DetectionAdapter(small_detector(...))`
dispatches, the ones among them that make the host wait for a GPU, and its seconds on the CPU, for a batch of fastai's
padded boxes. On a GPU each op is a kernel launch or a host-side step, so fewer ops a step is less host time, and each
wait stops the host until the device has caught up. `--checkout DIR` measures another checkout's detector (a `git
worktree` of an older commit) with this checkout's counter, so two commits are counted alike.

    python tools/detection_ops.py [--arch fcos] [--bs 64] [--size 64] [--checkout DIR]"""
import argparse, importlib, sys, time, warnings

import torch
from fastai.vision.all import TensorBBox, TensorMultiCategory

from dali_fastai.faststep import OpCounts


def detector_modules(checkout:str|None):
    "`small_detector`, `DetectionAdapter` and `detection_loss` of `checkout`'s dali_fastai (default: this one's)"
    if checkout:
        for k in [k for k in sys.modules if k == 'dali_fastai' or k.startswith('dali_fastai.')]: del sys.modules[k]
        sys.path.insert(0, checkout)
    det = importlib.import_module('dali_fastai.detection')
    small = getattr(det, 'small_detector', None) # there before the detectors had a module of their own
    return small or importlib.import_module('dali_fastai.detectors').small_detector,det.DetectionAdapter,det.detection_loss


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--arch', default='fcos', choices=['fcos', 'retinanet'])
    p.add_argument('--bs', type=int, default=64); p.add_argument('--size', type=int, default=64)
    p.add_argument('--checkout', default=None, help="another checkout's folder, whose detector is measured")
    a = p.parse_args()
    small_detector,DetectionAdapter,detection_loss = detector_modules(a.checkout)
    warnings.filterwarnings('ignore'); torch.manual_seed(0)
    model = DetectionAdapter(small_detector(4, a.size, a.arch, fpn_channels=32))
    x = torch.randn(a.bs, 3, a.size, a.size)
    lo = torch.rand(a.bs, 3, 2)*1.2 - 1  # 3 boxes an image, in fastai's [-1, 1]
    boxes,labels = TensorBBox(torch.cat([lo, lo + 0.5], -1)),TensorMultiCategory(torch.randint(1, 4, (a.bs, 3)))
    def step(): detection_loss(model(x, boxes, labels)).backward()
    step()
    with OpCounts() as ops: step()
    secs = []
    for _ in range(3):
        start = time.perf_counter(); step(); secs.append(time.perf_counter() - start)
    print(f"{a.arch}, bs {a.bs}, {a.size} px: {ops.n} aten ops a training step, {ops.waits} of them waits for a GPU, "
          f"{min(secs):.3f} s a step on the CPU (best of 3)")


if __name__ == '__main__': main()
