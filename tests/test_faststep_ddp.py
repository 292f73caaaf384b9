"""`FastStep` under DDP, two processes on the CPU (gloo) through fastai's `distrib_ctx` and `DaliDistributed`: the same
exactly-once and whole-set-metric checks as without it (`ddp_worker.check`), with the fused optimizer in place."""
import json, os, socket, subprocess, sys
from pathlib import Path

import pytest

import ddp_worker

HERE = Path(__file__).parent


def test_two_processes_with_fast_step(tmp_path):
    pytest.importorskip('accelerate', reason="fastai's distrib_ctx needs accelerate (a dev dependency)")
    with socket.socket() as s: s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', '2', '--master_port', str(port),
           str(HERE/'ddp_worker.py'), str(tmp_path), '--fast-step']
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, 'OMP_NUM_THREADS': '1'})
    assert r.returncode == 0, r.stderr[-3000:]
    ddp_worker.check(tmp_path)
    assert {json.loads((tmp_path/f'rank{i}.json').read_text())['opt'] for i in range(2)} == {'FastOptimizer'}
