"""Why a first pipeline build costs 2-3 s on one GPU and 4.5-9 s a rank when 2 or 4 ranks build at once (DDP), and
what shortens it: each way in fresh processes.

    python tools/build_starts.py

tools/decoder_backends.py (one H200, 2026-11-27) found the start in nvImageCodec's hardware (1.43 s) and hybrid (1.30 s)
JPEG backends, 1.76 s together, against 16 ms for the CUDA backend alone; tools/ddp_bench.py's FastStep() row spent 3.00 /
4.49 / 8.93 s of its first epoch on pipeline builds on 1 / 2 / 4 GPUs. Both backends work from pinned host memory, and
pinning is slow and shared by every process on the host, so the cases here ask whether the start is memory pinning:
- `pin`: the host's pinning rate (256 MB and 1 GB through PyTorch's `pin_memory`);
- `build`: the bench's training pipeline (classification, 224 px, bs 64), its first build (the decoder not kept);
- `build, DALI_RESTRICT_PINNED_MEM=1`: the same, DALI told to keep pinned memory small;
- `prepinned`: DALI's pinned pool grown by 512 MB first (`PreallocatePinnedMemory`), then the build;
- `N at once`: `build` in N processes on N GPUs started together (a DDP fit's start), default and restricted.
GPU only.
"""
import json, os, subprocess, sys, time

CHILD = r'''
import json, sys, time, warnings
warnings.filterwarnings('ignore')
import torch
mode,clock,out = sys.argv[1],time.perf_counter,{}
a = clock(); torch.zeros(1, device='cuda'); torch.cuda.synchronize(); out['CUDA start'] = clock() - a
if mode == 'pin':
    for mb in (256, 1024):
        a = clock(); x = torch.empty(mb*2**20, dtype=torch.uint8, pin_memory=True); out[f'pin {mb} MB'] = clock() - a; del x
else:
    from dali_fastai.stepbench import _task_data
    from dali_fastai.data import DaliDataLoaders
    import dali_fastai.loader; dali_fastai.loader.keep_decoder = lambda *a: None  # the pipeline's own decoder only
    t,src,db = _task_data('classification', None, None)
    dls = DaliDataLoaders.from_dblock(db, src, bs=64, device='cuda', seed=0, decode_on='gpu')  # the GPU decoder's start
    if mode == 'prepinned':
        from nvidia.dali import backend
        a = clock(); backend.PreallocatePinnedMemory(512*2**20); out['pin 512 MB in DALI'] = clock() - a
    a = clock(); p = dls.train._pipeline(0, 0); p.build(); out['first build'] = clock() - a
    a = clock(); p.run(); torch.cuda.synchronize(); out['its first batch'] = clock() - a
print('RESULT ' + json.dumps(out))
'''


def child(mode:str, gpu:int=0, restrict:bool=False)->subprocess.Popen:
    env = {**os.environ, 'CUDA_VISIBLE_DEVICES': str(gpu), **({'DALI_RESTRICT_PINNED_MEM': '1'} if restrict else {})}
    return subprocess.Popen([sys.executable, '-c', CHILD, mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def result(p:subprocess.Popen)->str:
    out,err = p.communicate(timeout=300)
    line = next((l for l in out.splitlines() if l.startswith('RESULT ')), None)
    if line is None: return f"failed: {err.strip().splitlines()[-1:]}"
    return ', '.join(f"{k} {v:.3f} s" for k,v in json.loads(line[7:]).items())


def main():
    import torch; n = torch.cuda.device_count()
    for name,mode,restrict in (('pin', 'pin', False), ('build', 'build', False), ('build, DALI_RESTRICT_PINNED_MEM=1', 'build', True),
                               ('prepinned', 'prepinned', False)):
        print(f"{name:<35}{result(child(mode, 0, restrict))}", flush=True)
    for restrict in (False, True):
        for k in sorted({2, n}):
            if k < 2 or k > n: continue
            a = time.perf_counter(); ps = [child('build', g, restrict) for g in range(k)]
            rs = [result(p) for p in ps]
            print(f"{k} at once{', restricted' if restrict else ''} ({time.perf_counter() - a:.1f} s in all):", flush=True)
            for g,r in enumerate(rs): print(f"  GPU {g}: {r}", flush=True)
    for k in sorted({2, n}):
        if k < 2 or k > n: continue
        ps = [child('pin', g) for g in range(k)]
        print(f"pin, {k} at once: " + ' | '.join(result(p) for p in ps), flush=True)


if __name__ == '__main__': main()
