"""Where the session bench's 'loaders + learner' phase goes, each run in a fresh process, plain clocks:

    python tools/loaders_phase.py

The bench child's imports, then `_task_data` (the DataBlock and the bench's folder), the loaders
(`DaliDataLoaders.from_dblock`: the items, the files' check, the training pipeline prepared, validation read ahead on
a thread, the GPU libraries' thread started), the learner (`vision_learner` + `FastStep()`), the wait for the read
ahead (`reads_ahead_done`, what the bench counts in the phase) and for the libraries' thread. Modes alternate: 'plain'
as the bench runs, 'cuda-first' with CUDA started before the loaders. GPU only. Read on an H200 (2026-11-29,
nbs/images/loaders_phase_h200_20261129.txt): 1.49-1.74 s with `_task_data`'s 0.32-0.35 s (the bench starts its
clock after it: 1.17-1.37 s; the first run, which wrote the images, left out), of which the loaders 0.60-1.12 s, the
learner 0.39-0.59 s, the read ahead's rest 0.00-0.18 s; CUDA had started during the imports (0.002-0.009 s left), so the
two modes differ by noise; the imports took 12-19 s on a machine just unpacked.
"""
import subprocess, sys
CHILD = r'''
import time, warnings, sys, threading
warnings.filterwarnings('ignore')
clock = time.perf_counter
t0 = clock()
import torch
from dali_fastai.sessionbench import session_run  # the bench child's imports
from dali_fastai.stepbench import _task_data
from dali_fastai.data import DaliDataLoaders
from dali_fastai.faststep import FastStep
from dali_fastai.epoch import reads_ahead_done, gpu_libraries_started
from fastai.torch_core import set_seed
ti = clock()
a = clock()
t,src,db = _task_data('classification', None, 224); t1 = clock()
set_seed(0, reproducible=False)
if sys.argv[1] == 'cuda-first': torch.zeros(1, device='cuda'); torch.cuda.synchronize()
tc = clock()
dls = DaliDataLoaders.from_dblock(db, src, bs=64, device='cuda', seed=0); t2 = clock()
learn = t.learner(dls, [FastStep()], metric=True, size=224); t3 = clock()
reads_ahead_done(); t4 = clock()
gpu_libraries_started(); t5 = clock()
print(f"{sys.argv[1]:10} imports {ti-t0:.2f} | task_data {t1-a:.3f} cuda {tc-t1:.3f} loaders {t2-tc:.3f} learner {t3-t2:.3f} "
      f"read-ahead wait {t4-t3:.3f} | phase {t4-a:.3f} | libraries +{t5-t4:.3f}")
'''
for mode in ('plain', 'cuda-first') * 3:
    r = subprocess.run([sys.executable, '-c', CHILD, mode], capture_output=True, text=True)
    print(r.stdout.strip() if r.returncode == 0 else r.stderr[-2000:], flush=True)
