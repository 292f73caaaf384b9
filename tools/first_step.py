"""What `lr_find`'s first batches pay, and what the loaders' starts ahead hide: each mode in a fresh process, the session
bench's folder, loaders and learner (`FastStep(graph=True)`), timed from before the loaders to the end of `lr_find`:

    python tools/first_step.py [--seeds 0 1 2] [--modes before prepared default norm]

- before: neither start ahead (`DaliDataLoader.prepare` and `start_gpu_libraries` stubbed out), as before they were made;
- prepared: the loaders prepare their training pipeline (its first batches made while the learner is built), but start
  no GPU libraries;
- default: as the session bench runs it: the GPU's libraries started on a thread when the loaders are made
  (`start_gpu_libraries`), and the training pipeline prepared;
- norm: default, then a `Normalize` added (what `vision_learner` does for a pretrained model), which prepares the rebuilt
  pipeline.
Prints, per mode and seed: the loaders' and the learner's seconds, `lr_find`'s, and what `lr_find` spent on the capture
and on its first batches. GPU only."""
import argparse, json, subprocess, sys

CHILD = r'''
import json, sys, threading, time, warnings
warnings.filterwarnings('ignore')
import torch
from fastai.callback.schedule import lr_find  # noqa: F401
from dali_fastai.faststep import FastStep
from dali_fastai.sessionbench import _task_data, _loaders, _quiet, start_costs
from fastai.torch_core import set_seed
mode,seed = sys.argv[1],int(sys.argv[2])
clock = time.perf_counter

t,src,db = _task_data('classification', None, 224)
device = torch.device('cuda')
torch.zeros(1, device=device); torch.cuda.synchronize()
from unittest import mock
from dali_fastai import epoch
from dali_fastai.loader import DaliDataLoader
out = {}
start = clock()
set_seed(seed, reproducible=False)
if mode in ('before', 'prepared'):  # as if started already: none starts
    epoch._STARTING[0] = threading.Thread(target=lambda: None); epoch._STARTING[0].start()
if mode == 'before': mock.patch.object(DaliDataLoader, 'prepare', lambda self: None).start()
dls = _loaders('dali_fastai + FastStep(graph=True)', db, src, 64, device, seed, None)
if mode == 'norm':
    from fastai.data.transforms import Normalize
    from fastai.vision.core import imagenet_stats
    dls.add_tfms([Normalize.from_stats(*imagenet_stats)], 'after_batch')
out['loaders'] = clock() - start
learn = t.learner(dls, [FastStep(graph=True)], metric=True, size=224)
out['loaders + learner'] = clock() - start
c = start_costs(learn); a = clock()
with _quiet(learn): learn.lr_find(show_plot=False)
torch.cuda.synchronize()
out['lr_find'] = clock() - a
d = start_costs(learn)
out['capture'] = d['graph capture'] - c['graph capture']
out['first batches'] = d['first batches'] - c['first batches']
out['until lr_find ends'] = clock() - start
print('PROBE ' + json.dumps(out))
'''


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--seeds', type=int, nargs='+', default=[0, 1, 2])
    p.add_argument('--modes', nargs='+', default=['before', 'prepared', 'default', 'norm'])
    a = p.parse_args()
    from dali_fastai.stepbench import _task_data
    _task_data('classification', None, 224)  # the JPEGs written once, before the children
    for s in a.seeds:
        for m in a.modes:
            r = subprocess.run([sys.executable, '-c', CHILD, m, str(s)], capture_output=True, text=True)
            line = next((l for l in r.stdout.splitlines() if l.startswith('PROBE ')), None)
            if line is None: print(f"{m:6} seed {s}: failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}"); continue
            o = json.loads(line[6:])
            print(f"{m:6} seed {s}: " + '  '.join(f"{k} {v:.3f}" for k,v in o.items()), flush=True)


if __name__ == '__main__': main()
