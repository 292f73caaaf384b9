"""Where a lone DALI pipeline's first build goes: nvImageCodec's decoder extensions, each left out in turn.

    python tools/decoder_start.py

DALI's image decoders load nvImageCodec's extensions (nvjpeg, nvjpeg2k, nvtiff, libjpeg-turbo...) when the first decoder
of the process is made, and again once no decoder is alive. For each set of extensions (all of them; all but one, in
turn), a fresh process builds the bench's classification training pipeline (`bench_images(n_per_class=500)`, 224 px,
bs 64, on the GPU) with only that set visible (`NVIMGCODEC_EXTENSIONS_PATH`) and prints the build's seconds and its first
run's. Read on an H200 (2026-11-26, DALI 2.4.0, nvImageCodec 0.9): 2.2 s to build with every extension, 0.035 s without
the nvjpeg one and 2.2 s without any other: the nvjpeg extension's start is the whole of it. GPU only.
"""
import glob, os, subprocess, sys, tempfile

CHILD = r'''
import time, warnings, torch
warnings.filterwarnings('ignore')
from dali_fastai.stepbench import _task_data
from dali_fastai.data import DaliDataLoaders
torch.zeros(1, device='cuda'); torch.cuda.synchronize()
t,src,db = _task_data('classification', None, None)
dls = DaliDataLoaders.from_dblock(db, src, bs=64, device='cuda', seed=0)
a = time.perf_counter(); pipe = dls.train._pipeline(0, 0); pipe.build(); b = time.perf_counter()
pipe.run(); torch.cuda.synchronize(); c = time.perf_counter()
print(f"build {b-a:.3f} s, first run {c-b:.3f} s")
'''


def build_with(extensions:list|None)->str:
    "The child's line, with only `extensions` visible to nvImageCodec (None: its own folder, all of them)"
    env = dict(os.environ)
    if extensions is not None:
        d = tempfile.mkdtemp()
        for e in extensions: os.symlink(e, os.path.join(d, os.path.basename(e)))
        env['NVIMGCODEC_EXTENSIONS_PATH'] = d
    r = subprocess.run([sys.executable, '-c', CHILD], env=env, capture_output=True, text=True, timeout=120)
    return (r.stdout.strip().splitlines() or [''])[-1] if r.returncode == 0 else f"failed: {r.stderr.strip().splitlines()[-1:]}"


def main():
    import nvidia.nvimgcodec
    exts = sorted(glob.glob(os.path.join(os.path.dirname(nvidia.nvimgcodec.__file__), 'extensions', '*.so*')))
    print(f"{'every extension':34s} {build_with(None)}", flush=True)
    for e in exts:
        print(f"{'all but ' + os.path.basename(e).split('.')[0]:34s} {build_with([x for x in exts if x != e])}", flush=True)


if __name__ == '__main__': main()
