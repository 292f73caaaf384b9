"""Test session setup: headless plotting, the CPU cores shared out among pytest-xdist workers, the `gpu` marker, and
the index images most test files read"""
import os

import pytest

# Set before anything imports matplotlib or torch: the notebooks run inside these same worker processes.
# CUDA_VISIBLE_DEVICES is left alone: GPU-only cells carry `#| cuda` and are skipped here (`make gpu-test` runs them).
os.environ.setdefault('MPLBACKEND', 'Agg')  # plots render off-screen

# n workers that each start one thread per core oversubscribe an n-core CI box; give each worker its share.
_workers = int(os.environ.get('PYTEST_XDIST_WORKER_COUNT', '1'))
if _workers > 1:
    _threads = str(max(1, (os.cpu_count() or 1) // _workers))
    for _var in ('OMP_NUM_THREADS', 'MKL_NUM_THREADS', 'OPENBLAS_NUM_THREADS'): os.environ.setdefault(_var, _threads)


# Test modules whose tests share a costly module fixture (the docs pages, a trained learner): one worker runs them all
ONE_WORKER = ('test_docs.py', 'test_fastai_api.py')


@pytest.hookimpl(optionalhook=True)  # xdist's hook: absent under `-p no:xdist`
def pytest_xdist_make_scheduler(config, log):
    """`-n N` hands tests out one at a time, the modules of `ONE_WORKER` each whole to one worker (which makes their
    fixture once). xdist's default sends chunks of tests, and the chunk sent last kept one of the CI box's two workers
    busy for minutes after the other had run out. `--dist` given explicitly is left alone."""
    if config.getvalue('dist') != 'load': return None
    from xdist.scheduler import LoadScopeScheduling

    class OneAtATime(LoadScopeScheduling):
        "xdist's `loadscope` with a test as the unit of work, or a whole module for `ONE_WORKER`'s"
        def _split_scope(self, nodeid:str)->str:
            module = nodeid.split('::')[0]
            return module if module.rsplit('/', 1)[-1] in ONE_WORKER else nodeid

    return OneAtATime(config, log)


def pytest_collection_modifyitems(config, items):
    """Whole notebooks first, the last-numbered first of all (the benchmarks, the command line and the index train
    models): they are the longest tests, and a long one handed out last keeps one worker busy after the other is done"""
    nbs = [it for it in items if it.nodeid.startswith('tests/test_notebooks.py::test_notebook[')]
    ids = {id(it) for it in nbs}
    items[:] = nbs[::-1] + [it for it in items if id(it) not in ids]


def pytest_configure(config):
    config.addinivalue_line('markers', 'gpu: needs a GPU; `make gpu-test` runs these (helpers.needs_gpu)')
    config.addinivalue_line('markers', 'gpu_alone: reads the whole GPU\'s free memory, which other processes move: '
                                       '`make gpu-test` runs these on their own, after the others')


@pytest.fixture(scope='session', autouse=True)
def _tmp_in_pytest_tree(tmp_path_factory):
    "`tempfile`'s folders (the notebooks' `mkdtemp()`s, their subprocesses') go under one folder of the session, deleted at its end; session-scoped, so module fixtures get it too"
    import shutil, tempfile
    d = tmp_path_factory.mktemp('tempfile')
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv('TMPDIR', str(d)); mp.setattr(tempfile, 'tempdir', str(d))
        yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope='session')
def files(tmp_path_factory):
    "`MAX_INDEX` index images (`helpers.make_index_images`), shared by every test file that slices them"
    from helpers import make_index_images, MAX_INDEX  # here: helpers imports torch, which must follow the settings above
    return make_index_images(tmp_path_factory.mktemp('index'), MAX_INDEX)


def _importable(module:str)->bool:
    import importlib
    try: importlib.import_module(module); return True
    except ImportError: return False


def pytest_sessionstart(session):
    "A GPU run (`make gpu-test`) with no GPU visible stops here, loudly: its tests would otherwise fail one by one"
    if os.environ.get('DALI_FASTAI_GPU_TESTS') != '1': return
    import torch
    # the [dev] extra's modules the GPU tests import: a machine without network may lack some (they travel as wheels)
    missing = [m for m in ('webdataset', 'google_crc32c', 'torchmetrics', 'pycocotools', 'kornia', 'execnb', 'IPython')
               if not _importable(m)]
    if missing:
        raise pytest.UsageError(f"DALI_FASTAI_GPU_TESTS=1 (make gpu-test) but {', '.join(missing)} cannot be imported here, "
                                "and the tests that need them would fail one by one: pip install -e '.[dev]', or put "
                                "their wheels' contents on PYTHONPATH")
    if not torch.cuda.is_available():
        raise pytest.UsageError("DALI_FASTAI_GPU_TESTS=1 (make gpu-test) but PyTorch sees no GPU: run it on the GPU "
                                "machine, or check CUDA_VISIBLE_DEVICES and the driver")
