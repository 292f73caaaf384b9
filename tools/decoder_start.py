"""Where a lone DALI pipeline's first build goes: nvImageCodec's decoder extensions, each left out in turn.

    python tools/decoder_start.py

DALI's image decoders load nvImageCodec's extensions (nvjpeg, nvjpeg2k, nvtiff, libjpeg-turbo...) when the first decoder
of the process is made, and again once no decoder is alive. For each set of extensions (all of them; all but one, in
turn), a fresh process builds the bench's classification training pipeline (`bench_images(n_per_class=500)`, 224 px,
bs 64, on the GPU) with only that set visible (`NVIMGCODEC_EXTENSIONS_PATH`) and prints the build's seconds and its first
run's. Read on an H200 (2026-11-26, DALI 2.4.0, nvImageCodec 0.9): 2.2 s to build with every extension, 0.035 s without
the nvjpeg one and 2.2 s without any other: the nvjpeg extension's start is the whole of it. GPU only.

    python tools/decoder_start.py --cpu-decode [--threads 16]

The same, with the loaders' JPEGs decoded on DALI's CPU threads (`decode_on='cpu'`): whether a pipeline that never
decodes on the GPU still pays the nvjpeg extension's start. Its first line gives nvImageCodec every extension (its own
folder, named in NVIMGCODEC_EXTENSIONS_PATH, which the loaders leave alone), its second the loaders' own way
(`cpu_codecs`: the CPU extensions only). In both modes each child then builds the
validation pipeline after the training one, and prints that second build's seconds and the three calls it spent most of
them in (cProfile, by own time): a second build paid 0.58-0.62 s in the session bench with either decoder (H200,
2026-11-27).
"""
import argparse, os, subprocess, sys, tempfile
from dali_fastai.pipeline import nvimgcodec_extensions

CHILD = r'''
import cProfile, pstats, sys, time, warnings, torch
warnings.filterwarnings('ignore')
from dali_fastai.stepbench import _task_data
from dali_fastai.data import DaliDataLoaders
torch.zeros(1, device='cuda'); torch.cuda.synchronize()
t,src,db = _task_data('classification', None, None)
kw = dict(decode_on='gpu') if len(sys.argv) == 1 else dict(decode_on='cpu', num_threads=int(sys.argv[1]))
dls = DaliDataLoaders.from_dblock(db, src, bs=64, device='cuda', seed=0, **kw)
a = time.perf_counter(); pipe = dls.train._pipeline(0, 0); pipe.build(); b = time.perf_counter()
pipe.run(); torch.cuda.synchronize(); c = time.perf_counter()
prof = cProfile.Profile(); d = time.perf_counter(); prof.enable()
dls.valid._pipeline(0, 0).build(); prof.disable(); e = time.perf_counter()
calls = sorted(((v[2], f[2]) for f,v in pstats.Stats(prof).stats.items()), reverse=True)[:3]  # (own time, name)
print(f"build {b-a:.3f} s, first run {c-b:.3f} s; then the validation build {e-d:.3f} s: "
      + ', '.join(f"{n} {t:.3f}" for t,n in calls))
'''


def build_with(extensions:list|None, # the extensions nvImageCodec may load; None: its own folder, all of them
               threads:int|None=None, # decode on DALI's CPU threads, this many a pipeline (None: on the GPU)
              )->str:
    "The child's line, with only `extensions` visible to nvImageCodec"
    env = dict(os.environ)
    if extensions is not None:
        d = tempfile.mkdtemp()
        for e in extensions: os.symlink(e, os.path.join(d, os.path.basename(e)))
        env['NVIMGCODEC_EXTENSIONS_PATH'] = d
    r = subprocess.run([sys.executable, '-c', CHILD, *([] if threads is None else [str(threads)])], env=env, capture_output=True, text=True, timeout=120)
    return (r.stdout.strip().splitlines() or [''])[-1] if r.returncode == 0 else f"failed: {r.stderr.strip().splitlines()[-1:]}"


def main(argv:list|None=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--cpu-decode', action='store_true', help="the loaders decode on DALI's CPU threads (decode_on='cpu')")
    p.add_argument('--threads', type=int, default=16, help="--cpu-decode: DALI's CPU threads a pipeline (default: 16)")
    p.add_argument('--leave-out', nargs='*', default=None, help="the extensions to leave out one at a time, by name (e.g. "
                   "libnvjpeg_ext; default: each)")
    a = p.parse_args(argv)
    threads = a.threads if a.cpu_decode else None
    exts = nvimgcodec_extensions()
    if threads is None: print(f"{'every extension':34s} {build_with(None)}", flush=True)
    else:
        print(f"{'every extension':34s} {build_with(exts, threads)}", flush=True)
        own = "cpu_codecs (the loaders' own)"
        print(f"{own:34s} {build_with(None, threads)}", flush=True)
    for e in exts:
        if a.leave_out is not None and os.path.basename(e).split('.')[0] not in a.leave_out: continue
        print(f"{'all but ' + os.path.basename(e).split('.')[0]:34s} {build_with([x for x in exts if x != e], threads)}", flush=True)


if __name__ == '__main__': main()
