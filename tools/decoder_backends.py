"""Which of nvImageCodec's JPEG decoders costs a process its 2.2 s start, whether that start lets Python run meanwhile,
and whether a decoder made outside DALI keeps the start paid for DALI's first build.

    python tools/decoder_backends.py [MODE ...]

tools/decoder_start.py found the whole of a first pipeline build's 2.2 s in nvImageCodec's nvjpeg extension, and
tools/session_starts.py that `hw_decoder_load=0` does not shorten it (DALI 2.4 lists the hardware backend whatever its
load) and that a build on a thread holds Python's lock all along. Here each case runs in a fresh process, after CUDA's
start, with nvImageCodec's own Python API (`nvidia.nvimgcodec.Decoder`). That API starts a backend at its first decode
(DALI asks nvImageCodec to start them when the decoder is made), so each start below is the decoder made and one
224-pixel JPEG decoded on the GPU, timed to the end of the GPU's work:
- `hw`, `cuda`, `hybrid`, `all`: a decoder allowed only the hardware backend, only the CUDA one, only the hybrid one, or
  every backend (DALI's list), started; then another started while the first is alive;
- `hw-prealloc`: the hardware backend with DALI's options for the bench's pipelines (batch 64, 1024 px hints);
- `thread`: the `all` decoder started on a thread while the main thread counts; the share of its usual count it reached
  says how much of the start Python could use;
- `kept-then-dali`: the `all` decoder kept alive, then the bench's training pipeline built by DALI: does DALI's build
  then skip the start (as with `keep_decoder`'s DALI decoder)?
Each start checks that the JPEG came out decoded (224 x 224 x 3). GPU only. A first run (4 x H200, 2026-11-27, nbs/images/ddp_h200x4_20261127.txt) made the decoders without decoding:
each took 10 ms, and a kept one left DALI's first build at 2.36 s.
A second run (one H200 of 4, 2026-11-27, nbs/images/decoder_starts_h200x4.txt) decoded: all 1.76 s, hw 1.43 s, hw-prealloc
1.66 s, hybrid 1.30 s; thread 2.52 s, the main thread keeping 20% of its count; kept-then-dali 2.73 s, then DALI's first
build 0.86 s. Its `cuda` case (0.016 s) had decoded nothing: the check of each decode was added after it, and a rerun
reports that case as failed (hybrid then 0.91 s; hw 5.73 s, but beside tests that started pipelines on the other GPUs).
"""
import json, subprocess, sys

CHILD = r'''
import io, json, sys, threading, time, warnings
warnings.filterwarnings('ignore')
import numpy as np, torch
from PIL import Image
from nvidia import nvimgcodec
buf = io.BytesIO(); Image.fromarray(np.random.default_rng(0).integers(0, 255, (224, 224, 3), dtype=np.uint8)).save(buf, 'JPEG')
jpeg = buf.getvalue()
mode,clock,out = sys.argv[1],time.perf_counter,{}
a = clock(); torch.zeros(1, device='cuda'); torch.cuda.synchronize(); out['CUDA start'] = clock() - a
K = nvimgcodec.BackendKind
kinds = {'hw': [K.HW_GPU_ONLY], 'hw-prealloc': [K.HW_GPU_ONLY], 'cuda': [K.GPU_ONLY], 'hybrid': [K.HYBRID_CPU_GPU]}
opts = ('nvjpeg_hw_decoder:preallocate_batch_size=64 nvjpeg_hw_decoder:preallocate_width_hint=1024 '
        'nvjpeg_hw_decoder:preallocate_height_hint=1024') if mode == 'hw-prealloc' else ':fancy_upsampling=0'
def make():
    ks = kinds.get(mode)
    d = nvimgcodec.Decoder(device_id=0, backends=None if ks is None else [nvimgcodec.Backend(k) for k in ks], options=opts)
    img = d.decode(jpeg); torch.cuda.synchronize()  # the backend starts here
    if img is None or tuple(img.shape) != (224, 224, 3): raise RuntimeError(f"{mode}: the JPEG was not decoded ({img})")
    return d
if mode == 'thread':
    def count(seconds):
        n,end = 0,clock() + seconds
        while clock() < end: n += 1
        return n
    alone = count(0.5)/0.5
    made = {}
    def build(): a = clock(); made['d'] = make(); made['s'] = clock() - a
    th = threading.Thread(target=build); a = clock(); th.start()
    n = 0
    while th.is_alive(): n += 1
    out['start, on a thread'] = made['s']
    out['share of its count the main thread kept meanwhile'] = n/(alone*(clock() - a))
elif mode == 'kept-then-dali':
    a = clock(); kept = make(); out['nvimgcodec decoder'] = clock() - a
    from dali_fastai.stepbench import _task_data
    from dali_fastai.data import DaliDataLoaders
    import dali_fastai.loader; dali_fastai.loader.keep_decoder = lambda *a: None  # DALI's own decoders only
    t,src,db = _task_data('classification', None, None)
    dls = DaliDataLoaders.from_dblock(db, src, bs=64, device='cuda', seed=0, decode_on='gpu')
    a = clock(); p = dls.train._pipeline(0, 0); p.build(); out['then DALI first build'] = clock() - a
else:
    a = clock(); d1 = make(); out['first start'] = clock() - a
    a = clock(); d2 = make(); out['second, the first alive'] = clock() - a
print('RESULT ' + json.dumps(out))
'''


MODES = ('all', 'hw', 'hw-prealloc', 'cuda', 'hybrid', 'thread', 'kept-then-dali')


def main():
    for mode in sys.argv[1:] or MODES:  # e.g. `python tools/decoder_backends.py cuda hw`: those cases only
        r = subprocess.run([sys.executable, '-c', CHILD, mode], capture_output=True, text=True, timeout=300)
        line = next((l for l in r.stdout.splitlines() if l.startswith('RESULT ')), None)
        if line is None: print(f"{mode}: failed: {r.stderr.strip().splitlines()[-3:]}", flush=True); continue
        print(f"{mode:<15}" + ', '.join(f"{k} {v:.3f}" + ('' if 'share' in k else ' s') for k,v in json.loads(line[7:]).items()), flush=True)


if __name__ == '__main__': main()
