"""How much work a detector's training step asks of PyTorch: the aten ops one step of `DetectionAdapter(small_detector(...))`
dispatches, the ones among them that make the host wait for a GPU, and its seconds on the CPU, for a batch of fastai's
padded boxes. On a GPU each op is a kernel launch or a host-side step, so fewer ops a step is less host time, and each
wait stops the host until the device has caught up; run it on two checkouts to compare them.

    python tools/detection_ops.py [--arch fcos] [--bs 64] [--size 64]"""
import argparse, time, warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from fastai.vision.all import TensorBBox, TensorMultiCategory

from dali_fastai.detectors import small_detector
from dali_fastai.detection import DetectionAdapter, detection_loss


class Ops(TorchDispatchMode):
    "Count the aten ops dispatched, and those a GPU makes the host wait for (a value read, `nonzero`, a boolean-mask index)"
    WAITS = (torch.ops.aten._local_scalar_dense, torch.ops.aten.nonzero)
    MASKED = (torch.ops.aten.index, torch.ops.aten.index_put, torch.ops.aten.index_put_)
    def __init__(self): super().__init__(); self.n,self.waits = 0,0
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        op = func.overloadpacket
        self.n += 1
        self.waits += op in self.WAITS or (op in self.MASKED and any(i is not None and i.dtype == torch.bool for i in args[1]))
        return func(*args, **(kwargs or {}))


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--arch', default='fcos', choices=['fcos', 'retinanet'])
    p.add_argument('--bs', type=int, default=64); p.add_argument('--size', type=int, default=64)
    a = p.parse_args()
    warnings.filterwarnings('ignore'); torch.manual_seed(0)
    model = DetectionAdapter(small_detector(4, a.size, a.arch, fpn_channels=32))
    x = torch.randn(a.bs, 3, a.size, a.size)
    lo = torch.rand(a.bs, 3, 2)*1.2 - 1  # 3 boxes an image, in fastai's [-1, 1]
    boxes,labels = TensorBBox(torch.cat([lo, lo + 0.5], -1)),TensorMultiCategory(torch.randint(1, 4, (a.bs, 3)))
    def step(): detection_loss(model(x, boxes, labels)).backward()
    step()
    with Ops() as ops: step()
    secs = []
    for _ in range(3):
        start = time.perf_counter(); step(); secs.append(time.perf_counter() - start)
    print(f"{a.arch}, bs {a.bs}, {a.size} px: {ops.n} aten ops a training step, {ops.waits} of them waits for a GPU, "
          f"{min(secs):.3f} s a step on the CPU (best of 3)")


if __name__ == '__main__': main()
