"""What a session's starts cost on the GPU, each way in a fresh process: CUDA's start, a pipeline's first build (the JPEG
decoder's start), a second build while the first pipeline is alive, one after every pipeline was freed, the first
batch; the same with the decoder `keep_decoder` keeps (and the GPU memory it holds); with the hardware decoder off
(`hw_decoder_load=0`); and a build on a thread while the main thread makes the model. The modes other than 'kept' stub
`keep_decoder` out, to show what a build costs without it.

    python tools/session_starts.py

The classification task's training pipeline (`bench_images(n_per_class=500)`, 224 px, `RandomResizedCrop` +
`aug_transforms()`, bs 64). GPU only.
"""
import json, subprocess, sys

CHILD = r'''
import gc, json, sys, threading, time, warnings
warnings.filterwarnings('ignore')
import torch
from dali_fastai.stepbench import _task_data
from dali_fastai.data import DaliDataLoaders
mode,clock,out = sys.argv[1],time.perf_counter,{}
a = clock(); torch.zeros(1, device='cuda'); torch.cuda.synchronize(); out['CUDA start'] = clock() - a
t,src,db = _task_data('classification', None, None)
dls = DaliDataLoaders.from_dblock(db, src, bs=64, device='cuda', seed=0, decode_on='gpu',  # the GPU decoder's start
                                  **({'hw_decoder_load': 0.} if mode == 'hw0' else {}))
def build(dl):
    a = clock(); p = dl._pipeline(0, 0); p.build(); return p,clock() - a
if mode != 'kept':  # as before `keep_decoder`: no decoder kept beside the pipelines
    import dali_fastai.loader; dali_fastai.loader.keep_decoder = lambda *a: None
def first_run(p):
    a = clock(); p.run(); torch.cuda.synchronize(); return clock() - a
def model():
    a = clock(); learn = t.learner(dls, [], metric=True, size=224); learn.model.cuda(); torch.cuda.synchronize(); return clock() - a
if mode == 'kept':  # the loaders keep a decoder (`keep_decoder`) beside their first pipeline
    from dali_fastai.pipeline import _KEPT
    free = torch.cuda.mem_get_info()[0]
    p1,out['first build, with the kept decoder'] = build(dls.train)
    del p1; gc.collect()
    p2,out['a build once the first was freed'] = build(dls.valid)
    del p2; gc.collect(); torch.cuda.synchronize()
    a = torch.cuda.mem_get_info()[0]; _KEPT.clear(); gc.collect(); torch.cuda.synchronize()
    out['GPU MB the kept decoder holds'] = (torch.cuda.mem_get_info()[0] - a) / 2**20
elif mode in ('default', 'hw0'):
    p1,out['first build'] = build(dls.train)
    out['its first batch'] = first_run(p1)
    p2,out['second build, the first alive'] = build(dls.valid)
    del p1,p2; gc.collect()
    p3,out['a build once all were freed'] = build(dls.valid)
elif mode == 'thread':
    res,a = {},clock()
    th = threading.Thread(target=lambda: res.update(b=build(dls.train)[1])); th.start()
    out['model, main thread'] = model(); th.join()
    out['build, on a thread'] = res['b']; out['both, side by side'] = clock() - a
else:
    a = clock(); out['build'] = build(dls.train)[1]; out['model'] = model(); out['both, one after the other'] = clock() - a
print('RESULT ' + json.dumps(out))
'''


def main():
    for mode in ('default', 'kept', 'hw0', 'sequential', 'thread'):
        r = subprocess.run([sys.executable, '-c', CHILD, mode], capture_output=True, text=True, timeout=300)
        line = next((l for l in r.stdout.splitlines() if l.startswith('RESULT ')), None)
        if line is None: print(f"{mode}: failed: {r.stderr.strip().splitlines()[-1:]}", flush=True); continue
        print(f"{mode:<11}" + ', '.join(f"{k} {v:.3f}" + ('' if 'MB' in k else ' s') for k,v in json.loads(line[7:]).items()), flush=True)


if __name__ == '__main__': main()
