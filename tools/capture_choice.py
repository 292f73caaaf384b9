"""Which capture for `FastStep(graph=True)`? One H100 run, side by side, a synthetic batch kept on the GPU (no loader):

    python tools/capture_choice.py [--arch resnet18] [--bs 64] [--steps 100]

Rows (images per second after warm-up, and the seconds the capture or compile took):
- eager: the plain PyTorch step (bf16 autocast, channels_last, fused AdamW with fastai's Adam settings);
- graphed fwd+bwd: the model's forward and backward through `torch.cuda.make_graphed_callables` (what `FastStep(graph=True)`
  does), loss and fused optimizer eager;
- whole step in one graph: forward, loss, backward and a capturable fused AdamW (lr as a tensor) captured together with
  `torch.cuda.graph`: the ceiling of capturing the optimizer too;
- torch.compile reduce-overhead: `torch.compile(model, mode='reduce-overhead')`, loss and fused optimizer eager.
Also the host time one eager fused-AdamW step takes (what capturing the optimizer could save at most)."""
import argparse, time
import torch, torchvision
import torch.nn.functional as F


def make(arch:str):
    m = getattr(torchvision.models, arch)(num_classes=10).cuda().to(memory_format=torch.channels_last).train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, betas=(0.9, 0.99), eps=1e-5, weight_decay=0.01, fused=True)
    return m, opt


def rate(step, bs:int, steps:int, warmup:int=20)->float:
    for _ in range(warmup): step()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(steps): step()
    torch.cuda.synchronize()
    return bs*steps/(time.perf_counter() - t)


def eager(arch, x, y):
    m,opt = make(arch)
    def step():
        with torch.autocast('cuda', torch.bfloat16): loss = F.cross_entropy(m(x).float(), y)
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    return step, 0.


def graphed(arch, x, y):
    m,opt = make(arch)
    t = time.perf_counter()
    with torch.autocast('cuda', torch.bfloat16, cache_enabled=False): g = torch.cuda.make_graphed_callables(m, (x,))
    secs = time.perf_counter() - t
    def step():
        with torch.autocast('cuda', torch.bfloat16, cache_enabled=False): loss = F.cross_entropy(g(x).float(), y)
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    return step, secs


def whole(arch, x, y):
    m,_ = make(arch)
    opt = torch.optim.AdamW(m.parameters(), lr=torch.tensor(1e-3, device='cuda'), betas=(0.9, 0.99), eps=1e-5,
                            weight_decay=0.01, fused=True, capturable=True)
    t = time.perf_counter()
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            with torch.autocast('cuda', torch.bfloat16, cache_enabled=False): loss = F.cross_entropy(m(x).float(), y)
            loss.backward(); opt.step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(g):
        with torch.autocast('cuda', torch.bfloat16, cache_enabled=False): loss = F.cross_entropy(m(x).float(), y)
        loss.backward(); opt.step()
    secs = time.perf_counter() - t
    lr = opt.param_groups[0]['lr']
    def step(): lr.fill_(1e-3); g.replay()  # the schedule's write, then the step
    return step, secs


def compiled(arch, x, y):
    m,opt = make(arch)
    cm = torch.compile(m, mode='reduce-overhead')
    def step():
        with torch.autocast('cuda', torch.bfloat16): loss = F.cross_entropy(cm(x).float(), y)
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    t = time.perf_counter()
    for _ in range(3): step()
    torch.cuda.synchronize()
    return step, time.perf_counter() - t


def opt_host_us(arch, x, y, n:int=50)->float:
    "Host microseconds one fused AdamW step takes to launch (grads present)"
    m,opt = make(arch)
    with torch.autocast('cuda', torch.bfloat16): F.cross_entropy(m(x).float(), y).backward()
    for _ in range(5): opt.step()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(n): opt.step()
    host = (time.perf_counter() - t)/n*1e6
    torch.cuda.synchronize()
    return host


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--arch', default='resnet18'); p.add_argument('--bs', type=int, default=64)
    p.add_argument('--size', type=int, default=224); p.add_argument('--steps', type=int, default=100)
    a = p.parse_args()
    torch.backends.cudnn.benchmark = True
    x = torch.randn(a.bs, 3, a.size, a.size, device='cuda').to(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (a.bs,), device='cuda')
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {a.arch} bs {a.bs} {a.size}px bf16 channels_last, "
          f"a synthetic batch on the GPU; {a.steps} steps timed after 20")
    base = None
    for name,make_step in (('eager', eager), ('graphed fwd+bwd (FastStep graph=True)', graphed),
                           ('whole step in one graph', whole), ('torch.compile reduce-overhead', compiled)):
        try:
            step,secs = make_step(a.arch, x, y)
            r = rate(step, a.bs, a.steps)
            base = base or r
            print(f"{name:<40}{r:9.0f} img/s  {r/base:5.2f}x eager  (capture/compile {secs:5.1f} s)", flush=True)
        except Exception as e: print(f"{name:<40} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
    print(f"one fused AdamW step: {opt_host_us(a.arch, x, y):.0f} us of host time to launch")


if __name__ == '__main__': main()
