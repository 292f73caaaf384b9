"""Does a captured step under DDP lose the all-reduce's overlap with the backward, and does capturing the model in
chunks win it back? A plain PyTorch loop (no DALI, no fastai), one random batch kept on the GPU:

    torchrun --standalone --nproc_per_node 1 tools/ddp_overlap.py --bs 64     # then --nproc_per_node 2 (and 4)

Cases, each on a fresh torchvision resnet50 (bf16 autocast, channels_last, SGD with momentum), 5 untimed then 30 timed steps:
`eager` DDP as PyTorch runs it (each bucket's all-reduce starts while the backward goes on); `captured` the module inside
DDP replayed as one CUDA graph (`torch.cuda.make_graphed_callables`, as `FastStep(graph=True)` captures it: every gradient
comes when the whole backward has replayed, so every all-reduce waits for it); `chunks` the same model as a sequence of
`--chunks` parts (`chunks8`: 8) captured together (`make_graphed_callables` of a tuple), so each part's gradients reach DDP's hooks
while the earlier parts' backward replays; a case ending `-view` builds DDP with `gradient_as_bucket_view=True`, one
ending `-nobcast` with `broadcast_buffers=False`; `whole` captures the forward, the loss and the backward in one graph, DDP's
gradient all-reduce and buffer broadcast inside it (after 11 uncaptured steps, DDP built on the steps' stream, as PyTorch's
CUDA graphs notes ask for DDP): no DDP hook runs on the host at a replay. On one GPU the model is not wrapped in DDP, unless `--wrap-one`. Rank 0 prints img/s a GPU, the
all-reduce of the model's gradients alone (ms), and whether the weights agree across ranks."""
import argparse, re, time
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel


def sequential(model:nn.Module)->nn.Sequential:
    "torchvision's resnet as the sequence its forward runs"
    m = model
    return nn.Sequential(m.conv1, m.bn1, m.relu, m.maxpool, m.layer1, m.layer2, m.layer3, m.layer4, m.avgpool, nn.Flatten(1), m.fc)


def split(seq:nn.Sequential, n:int)->list:
    "`seq` (its `Sequential`s opened into their blocks) in at most `n` consecutive parts of about equal parameter counts"
    layers = [b for l in seq for b in (l if isinstance(l, nn.Sequential) else [l])]
    sizes = [sum(p.numel() for p in l.parameters()) for l in layers]
    total,parts,cur,acc,own = sum(sizes),[],[],0,0
    for l,s in zip(layers, sizes):
        cur.append(l); acc += s; own += s
        if own and acc >= total*(len(parts) + 1)/n and len(parts) < n - 1: parts.append(cur); cur,own = [],0
    if cur and parts and not any(p.numel() for l in cur for p in l.parameters()): parts[-1] += cur  # no part without parameters
    elif cur: parts.append(cur)
    return [nn.Sequential(*p) for p in parts]


def capture(parts:list, x:torch.Tensor):
    "Replay the parts as CUDA graphs, in order (their forwards replaced in place): each part's sample input is the one before's output"
    samples,h = [],x
    with torch.no_grad(), torch.autocast('cuda', dtype=torch.bfloat16):
        for p in parts:
            samples.append((h.detach().clone().requires_grad_(len(samples) > 0),))
            h = p(h)
    with torch.autocast('cuda', dtype=torch.bfloat16, cache_enabled=False):
        torch.cuda.make_graphed_callables(tuple(parts), tuple(samples), allow_unused_input=True)


def whole(ddp, opt, x:torch.Tensor, y:torch.Tensor, stream)->callable:
    "The forward, the loss and the backward, DDP's all-reduce included, captured as one CUDA graph on `stream`: a step is its replay and the optimizer's step"
    g = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)  # the captured backward makes the gradients, in the graph's memory: each replay writes them anew
    with torch.cuda.graph(g, stream=stream), torch.autocast('cuda', dtype=torch.bfloat16, cache_enabled=False):
        F.cross_entropy(ddp(x), y).backward()
    def step(): g.replay(); opt.step()
    return step


def run(case:str, bs:int, chunks:int, world:int, dev, wrap_one:bool=False)->tuple:
    torch.manual_seed(0)
    seq = sequential(torchvision.models.resnet50(num_classes=10)).to(dev, memory_format=torch.channels_last)
    # '-nobcast': DDP does not broadcast the BatchNorm statistics at every forward; '-view': `gradient_as_bucket_view=True`
    # (the gradients are views of DDP's buckets: no copy of them back from the buckets after the all-reduce)
    name,*flags = case.split('-')
    if not (name in ('eager', 'captured', 'whole') or re.fullmatch(r'chunks\d*', name)) or not set(flags) <= {'nobcast', 'view'}:
        raise SystemExit(f"--cases {case}: eager, captured, whole or chunks[N], then any of -nobcast and -view")
    parts = split(seq, int(name[6:] or chunks) if name.startswith('chunks') else 1)  # 'chunks8': 8 parts
    model = nn.Sequential(*parts)
    # the steps run on a stream of their own, where the parameters' AccumulateGrad nodes are made before DDP keeps them
    # (as `DaliDistributed` does): a capture cannot wait on the default stream
    side = torch.cuda.Stream(dev, priority=min(torch.cuda.Stream.priority_range()))
    with torch.cuda.stream(side): nodes = [q.view_as(q).grad_fn.next_functions[0][0] for q in model.parameters()]
    ddp = (DistributedDataParallel(model, device_ids=[dev.index], broadcast_buffers='nobcast' not in flags,
                                   gradient_as_bucket_view='view' in flags) if world > 1 or wrap_one else model)
    nodes = None
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(bs, 3, 224, 224, device=dev).to(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (bs,), device=dev)
    def step():
        with torch.autocast('cuda', dtype=torch.bfloat16): loss = F.cross_entropy(ddp(x), y)
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=False)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        for _ in range(11 if name == 'whole' else 3): step()  # DDP's buckets settle after its first steps: 11, as PyTorch's notes ask
        if name == 'whole': step = whole(ddp, opt, x, y, side)
        elif name != 'eager': capture(parts, x)
        for _ in range(5): step()
        torch.cuda.synchronize(); start = time.perf_counter()
        for _ in range(30): step()
        torch.cuda.synchronize(); secs = time.perf_counter() - start
    w = torch.cat([q.detach().flatten() for q in model.parameters()])
    same = True
    if world > 1:
        ws = [torch.zeros_like(w) for _ in range(world)]; dist.all_gather(ws, w); same = all(torch.equal(ws[0], v) for v in ws)
    return 30*bs/secs, same


def allreduce_ms(dev, n:int)->float:
    "Milliseconds of one all-reduce of `n` fp32 values (the gradients' size), after warm-up"
    t = torch.ones(n, device=dev)
    for _ in range(3): dist.all_reduce(t)
    torch.cuda.synchronize(); start = time.perf_counter()
    for _ in range(10): dist.all_reduce(t)
    torch.cuda.synchronize(); return (time.perf_counter() - start)*100


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--bs', type=int, default=64); p.add_argument('--chunks', type=int, default=4)
    p.add_argument('--cases', nargs='+', default=['eager', 'captured', 'chunks'])
    p.add_argument('--wrap-one', action='store_true', help="on one GPU too, the model wrapped in DDP (a one-process group): "
                   "what DDP's own work costs a step, no other rank to wait for")
    a = p.parse_args()
    dist.init_process_group('nccl'); rank,world = dist.get_rank(),dist.get_world_size()
    torch.cuda.set_device(rank); dev = torch.device('cuda', rank)
    n = sum(q.numel() for q in torchvision.models.resnet50(num_classes=10).parameters())
    ar = allreduce_ms(dev, n) if world > 1 else 0.
    for case in a.cases:
        img_s,same = run(case, a.bs, a.chunks, world, dev, a.wrap_one)
        if rank == 0: print(f"ddp_overlap {world} GPU(s){' (wrapped in DDP)' if world == 1 and a.wrap_one else ''} bs {a.bs}: {case:8} {img_s:,.0f} img/s a GPU; all-reduce of "
                            f"{n/1e6:.1f}M fp32 gradients alone {ar:.2f} ms; weights equal across ranks: {same}", flush=True)
    dist.destroy_process_group()


if __name__ == '__main__': main()
