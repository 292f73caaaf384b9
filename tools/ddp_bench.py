"""Training throughput of dali_fastai under DDP: run it with 1 and with 2 GPUs and compare the img/s lines.

    torchrun --nproc_per_node 1 tools/ddp_bench.py && torchrun --nproc_per_node 2 tools/ddp_bench.py

Every rank reads its own shard (`DaliDistributed`); `bs` is per GPU. Epoch 1 warms up (cuDNN, DALI); epoch 2 is timed."""
import argparse, contextlib, os, time

import torch
from fastai.callback.core import Callback
from fastai.callback.fp16 import MixedPrecision  # noqa: F401 (adds Learner.to_bf16)
from fastai.callback.schedule import fit_one_cycle  # noqa: F401 (adds Learner.fit_one_cycle)
from fastai.distributed import *  # noqa: F401,F403 (adds Learner.distrib_ctx)
from fastai.metrics import accuracy
from fastai.vision.learner import vision_learner
from torchvision.models import resnet50

from dali_fastai.bench import bench_images
from dali_fastai.distributed import DaliDistributed
from dali_fastai.loader import DaliDataLoaders


class EpochTimer(Callback):
    "Wall time of every training phase, synchronised with the GPU"
    def before_fit(self): self.times = []
    def before_train(self): torch.cuda.synchronize(); self.start = time.perf_counter()
    def after_train(self): torch.cuda.synchronize(); self.times.append(time.perf_counter() - self.start)


def main():
    p = argparse.ArgumentParser()
    p.add_argument('--path', default=None); p.add_argument('--bs', type=int, default=128); p.add_argument('--size', type=int, default=224)
    p.add_argument('--n-per-class', type=int, default=2000)
    a = p.parse_args()
    rank, world = int(os.environ.get('RANK', 0)), int(os.environ.get('WORLD_SIZE', 1))
    path = a.path or bench_images(n_per_class=a.n_per_class)  # the same folder on every rank (written once, atomically)
    dls = DaliDataLoaders.from_folder(path, valid_pct=0.1, bs=a.bs, size=a.size, seed=0)
    timer = EpochTimer()
    learn = vision_learner(dls, resnet50, metrics=accuracy, pretrained=False, cbs=[DaliDistributed(), timer]).to_bf16()
    learn.model = learn.model.to(memory_format=torch.channels_last)
    # one GPU: a plain fit (fastai's DistributedTrainer assumes a DDP-wrapped model, which one process does not get)
    with learn.distrib_ctx() if world > 1 else contextlib.nullcontext():
        learn.fit_one_cycle(2, 1e-3)
        n_batches = len(learn.dls.train)  # after the fit: the loaders are sharded at its start
    if rank == 0:
        imgs = n_batches*a.bs*world
        print(f"ddp_bench: {world} GPU(s), resnet50 bf16, bs {a.bs}/GPU, {imgs} images an epoch: "
              f"{imgs/timer.times[-1]:,.0f} img/s (epoch 2: {timer.times[-1]:.1f} s)", flush=True)


if __name__ == '__main__': main()
