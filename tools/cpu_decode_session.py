"""Issue 39's next lever, to measure: the session bench with every JPEG decoded on DALI's CPU threads (augmentation and
normalization still on the GPU), beside fastai's loaders and the default GPU decoding, each variant in a fresh process:

    python tools/cpu_decode_session.py [--threads 16] [--seeds 0 1] [--out session_cpu_decode.json]

The GPU's JPEG decoder (nvImageCodec's, in DALI) takes 2.3-2.7 s to start in every process, and `lr_find` is mostly
that start (the session bench notebook's readings); a pipeline that decodes on the CPU builds in hundredths of a second
but decodes each image more slowly. Which wins over a whole session is what this tool reads: the same phase table as
`dali-fastai bench --task session`, with a column for `FastStep()` fed by CPU decoding.

A diagnostic, not the library's way: in that variant's process the package's image decoders (`fn.decoders` in
`dali_fastai.pipeline` and `dali_fastai.steps`, `keep_decoder`'s included) are swapped for ones that decode on DALI's CPU
threads and hand the images to the GPU (`.gpu()`), and each pipeline gets `--threads` CPU threads instead of
`default_threads()`'s 8 at most. On the CPU backend it changes nothing: the decoders are on the CPU already. Written
2026-11-27 after that day's device time was spent: it has not run on a GPU yet.
"""
import argparse, json
from functools import partial
from pathlib import Path

BASE = 'dali_fastai + FastStep()'
CPU_DECODE = 'dali_fastai + FastStep(), CPU decode'
GPU_ONLY = ('hw_decoder_load', 'preallocate_width_hint', 'preallocate_height_hint', 'device_memory_padding',
            'host_memory_padding')  # arguments DALI's CPU decoders do not take


class CpuDecoders:
    "DALI's image decoders (`fn.decoders`) on DALI's CPU threads: one asked for the GPU ('mixed') hands its images to the GPU"
    def __init__(self, real): self.real = real
    def __getattr__(self, name):
        op = getattr(self.real, name)
        def decode(*args, device='cpu', **kwargs):
            images = op(*args, device='cpu', **{k: v for k,v in kwargs.items() if k not in GPU_ONLY})
            return images.gpu() if device == 'mixed' else images
        return decode


class CpuDecodingFn:
    "`nvidia.dali.fn` with its `decoders` swapped for `CpuDecoders`"
    def __init__(self, fn): self.fn,self.decoders = fn,CpuDecoders(fn.decoders)
    def __getattr__(self, name): return getattr(self.fn, name)


def decode_on_cpu(threads:int|None=None):
    "In this process: the package's image decoders on DALI's CPU threads, and `threads` CPU threads a pipeline (None: as before)"
    import dali_fastai.pipeline as pipeline, dali_fastai.steps as steps
    for m in (pipeline, steps):
        if not isinstance(m.fn, CpuDecodingFn): m.fn = CpuDecodingFn(m.fn)
    if threads: pipeline.default_threads = lambda: threads


CHILD = r'''
import json, sys
sys.path.insert(0, TOOLS)
from cpu_decode_session import decode_on_cpu, BASE, CPU_DECODE, CpuDecodingFn
import dali_fastai.pipeline as pipeline
from dali_fastai.sessionbench import session_run
kw = json.loads(sys.argv[1]); decode_on_cpu(kw.pop('threads')); kw['variant'] = BASE
r = session_run(**kw)
r.update(variant=CPU_DECODE, cpu_decode=dict(swapped=isinstance(pipeline.fn, CpuDecodingFn), threads=pipeline.default_threads()))
print('SESSION ' + json.dumps(r))
'''.replace('TOOLS', repr(str(Path(__file__).parent)))


def run(variant:str, # a variant of the session bench, or `CPU_DECODE`
        threads:int|None=None, # DALI's CPU threads a pipeline in the CPU-decode variant
        timeout:float=1800, **kwargs, # `session_run`'s settings
       )->dict:
    "`session_bench`'s `run`: `run_variant` for the bench's own variants, and for `CPU_DECODE` with a child that decodes on the CPU"
    from dali_fastai.sessionbench import run_variant
    if variant != CPU_DECODE: return run_variant(variant, timeout, **kwargs)
    return run_variant(variant, timeout, child=CHILD, threads=threads, **kwargs)


def main(argv:list|None=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('path', nargs='?', default=None, help="ImageNet-style folder (default: the session bench's)")
    p.add_argument('--threads', type=int, default=16, help="DALI's CPU threads a pipeline when decoding on the CPU (default: 16)")
    p.add_argument('--seeds', type=int, nargs='+', default=[0], help="a session per seed and variant (default: 0)")
    p.add_argument('--no-fastai', action='store_true', help="leave fastai's loaders out (their ratios then read '-')")
    p.add_argument('--device', default=None, help="'cpu' or 'gpu' (default: the GPU if visible)")
    p.add_argument('--size', type=int, default=224); p.add_argument('--bs', type=int, default=64)
    p.add_argument('--epochs', type=int, default=3); p.add_argument('--lr-find-its', type=int, default=100)
    p.add_argument('--out', default='session_cpu_decode.json', help="the sessions, as JSON (default: session_cpu_decode.json)")
    a = p.parse_args(argv)
    from dali_fastai.sessionbench import session_bench
    variants = ((), ('fastai',))[not a.no_fastai] + (BASE, CPU_DECODE)
    res = session_bench(a.path, variants, tuple(a.seeds), run=partial(run, threads=a.threads), size=a.size, bs=a.bs,
                        epochs=a.epochs, lr_find_its=a.lr_find_its, device=a.device)
    res['settings']['threads'] = a.threads
    Path(a.out).write_text(json.dumps(res, indent=1))
    return res


if __name__ == '__main__': main()
