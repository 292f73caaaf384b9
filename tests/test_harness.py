"""The test session's own checks (tests/conftest.py): a GPU run on a machine that lacks a module of the [dev] extra stops
before any test, naming the module, instead of failing the tests that need it one by one minutes later."""
import os, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_gpu_run_names_a_missing_dev_module_first():
    code = ("import sys; sys.modules['webdataset'] = None; import pytest; "  # as if webdataset were not installed
            "sys.exit(pytest.main(['-p', 'no:cacheprovider', '-p', 'no:xdist', '-q', 'tests/test_harness.py']))")
    r = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, 'DALI_FASTAI_GPU_TESTS': '1'})
    out = r.stdout + r.stderr
    assert r.returncode != 0 and 'webdataset cannot be imported here' in out and "pip install -e '.[dev]'" in out, out[-3000:]
    assert 'passed' not in out, out[-3000:]
