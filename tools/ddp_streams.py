"""DDP's kept gradient nodes and the stream the step runs on, in a plain PyTorch loop (no DALI, no fastai): 2 GPUs.

    for case in default adopted captured; do torchrun --standalone --nproc_per_node 2 tools/ddp_streams.py $case; done

DDP keeps each parameter's AccumulateGrad node from the moment it is built, and autograd runs a node on the stream it was
made on. `default`: DDP built on the default stream, the steps on a high-priority stream (what fastai's DistributedTrainer
and our loader did): every backward waits across the two, and PyTorch warns. `adopted`: the nodes made on the steps'
stream before DDP is built, which then keeps them (what `DaliDistributed` does now). `captured`: as `adopted`, with the
module inside DDP captured by `torch.cuda.make_graphed_callables` (as `FastStep(graph=True)` captures it; on the default
case the capture is invalidated). Rank 0 prints img/s a GPU, whether the weights agree across ranks, and the warnings.
resnet18, fp32, channels_last, SGD, one random batch of --bs a GPU, 5 untimed then 30 timed steps. nbs/images/
ddp_h200x2_20261127b.txt has the reading of 2026-11-27 (2 H200s), taken with the scratch script this tool was written from.
"""
import argparse, sys, time, warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel


def grad_nodes(model): return [p.view_as(p).grad_fn.next_functions[0][0] for p in model.parameters() if p.requires_grad]


def main():
    p = argparse.ArgumentParser()
    p.add_argument('case', choices=['default', 'adopted', 'captured']); p.add_argument('--bs', type=int, default=64)
    a = p.parse_args()
    dist.init_process_group('nccl'); rank = dist.get_rank(); torch.cuda.set_device(rank)
    dev = torch.device('cuda', rank)
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).to(dev, memory_format=torch.channels_last)
    high = torch.cuda.Stream(dev, priority=min(torch.cuda.Stream.priority_range()))
    made = None
    if a.case != 'default':
        with torch.cuda.stream(high): made = grad_nodes(model)  # DDP adopts the nodes alive when it is built
    ddp = DistributedDataParallel(model, device_ids=[rank])
    made = None
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(a.bs, 3, 224, 224, device=dev).to(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (a.bs,), device=dev)
    def step():
        F.cross_entropy(ddp(x), y).backward(); opt.step(); opt.zero_grad(set_to_none=False)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter('always')
        high.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(high):
            for _ in range(3): step()
            if a.case == 'captured':
                try: torch.cuda.make_graphed_callables(model, (x,), allow_unused_input=True)
                except Exception as e: print(f"rank {rank}: capture failed: {type(e).__name__}: {str(e)[:200]}"); sys.exit(1)
            for _ in range(5): step()
            torch.cuda.synchronize(); start = time.perf_counter()
            for _ in range(30): step()
            torch.cuda.synchronize(); secs = time.perf_counter() - start
    w = torch.cat([q.detach().flatten() for q in model.parameters()])
    ws = [torch.zeros_like(w) for _ in range(dist.get_world_size())]; dist.all_gather(ws, w)
    if rank == 0:
        print(f"{a.case}: {30*a.bs/secs:,.0f} img/s a GPU; weights equal across ranks: {all(torch.equal(ws[0], v) for v in ws)}; "
              f"warnings: {sorted({str(m.message)[:80] for m in said})}")
    dist.destroy_process_group()


if __name__ == '__main__': main()
