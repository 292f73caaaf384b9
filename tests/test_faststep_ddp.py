"""`FastStep` under DDP, two processes on the CPU (gloo) through fastai's `distrib_ctx` and `DaliDistributed`: the same
exactly-once and whole-set-metric checks as without it (`ddp_worker.check`), with the fused optimizer in place; with
`graph=True` on the CPU, one message saying why it is not captured; on two and four GPUs (NCCL), captured (the step and validation's forward), with the same checks; validation's
forward replayed through DDP's wrapping on one GPU.
Why a DDP model is not captured (find_unused_parameters, SyncBatchNorm, gloo), and the SyncBatchNorm note, on a
one-process group."""
import json, os, platform, socket, subprocess, sys, warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from fastai.callback.core import Callback, CancelFitException
from fastai.distributed import DistributedTrainer
from fastai.learner import Learner
from fastai.losses import CrossEntropyLossFlat
from fastai.metrics import accuracy

import ddp_worker
from helpers import GPU_RUN, index_loader, MAX_INDEX, needs_gpu
import dali_fastai.distributed as distributed
from dali_fastai.distributed import DaliDistributed
from dali_fastai.data import DaliDataLoaders
from dali_fastai.capture import GraphCapture
from dali_fastai.faststep import FastStep

HERE = Path(__file__).parent


def _torchrun(tmp_path, *args, device='cpu', nproc:int=2)->subprocess.CompletedProcess:
    "`ddp_worker.py` on `nproc` processes through torchrun; fails the test unless every one ends well"
    pytest.importorskip('accelerate', reason="fastai's distrib_ctx needs accelerate (a dev dependency)")
    with socket.socket() as s: s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', str(nproc), '--master_port', str(port),
           str(HERE/'ddp_worker.py'), str(tmp_path), '--device', device, *args]
    # the package these tests import first (this checkout's, or the copy `tools/mutants.py` plants a bug in)
    path = os.pathsep.join([str(Path(distributed.__file__).parents[1]), *filter(None, [os.environ.get('PYTHONPATH')])])
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, 'OMP_NUM_THREADS': '1', 'PYTHONPATH': path})
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def _ranks(tmp_path, key:str, world:int=2)->list: return [json.loads((tmp_path/f'rank{i}.json').read_text())[key] for i in range(world)]


def test_two_processes_with_fast_step(tmp_path):
    """`FastStep()` under DDP (gloo), one run for both: its optimizer with DDP's gradients as views of its buckets, which
    it asks fastai's DistributedTrainer for (`BucketViews`; fastai's own optimizer refuses them; DDP's default: the graph
    test below), exactly once, whole-set metrics, the same weights; and, the model holding a BatchNorm layer, DDP
    broadcast nothing at the forwards, and every rank validates and ends the fit with rank 0's statistics"""
    _torchrun(tmp_path, '--fast-step', '--bn')
    ddp_worker.check(tmp_path)
    assert set(_ranks(tmp_path, 'opt')) == {'FastOptimizer'} and _ranks(tmp_path, 'bucket_views') == [True, True]
    assert _ranks(tmp_path, 'forward_sync') == [[False, False]]*2, "DDP's broadcast off in both epochs, on both ranks"
    stats = _ranks(tmp_path, 'buffers')
    assert stats[0] == stats[1] and stats[0] != 0, stats
    at_validation = _ranks(tmp_path, 'valid_buffers')
    assert at_validation[0] == at_validation[1] and len(at_validation[0]) == 2, "each validation on every rank with rank 0's statistics"


def test_graph_on_the_cpu_says_why_once_and_trains(tmp_path):
    """`FastStep(graph=True)` under DDP on the CPU (gloo): one message, from rank 0, naming why; the uncaptured fast step
    trains exactly once, here with `bucket_view=False`: DDP built with its default, gradients copied from its buckets"""
    r = _torchrun(tmp_path, '--graph', '--no-bucket-view')
    ddp_worker.check(tmp_path)
    assert _ranks(tmp_path, 'bucket_views') == [False, False]
    said = [l for l in r.stderr.splitlines() if 'Warning: FastStep(graph=True):' in l]  # the message, not the source line under it
    assert len(said) == 1, r.stderr[-3000:]
    assert 'not on a CUDA device (DDP over gloo on the CPU)' in said[0] and 'uncaptured fast step' in said[0]
    assert all(g['n'] == 0 and 'gloo' in g['failed'] for g in _ranks(tmp_path, 'graphs'))
    assert set(_ranks(tmp_path, 'opt')) == {'FastOptimizer'}


@pytest.mark.gpu
@pytest.mark.parametrize('world', [2, 4])
def test_graph_under_ddp_on_gpus(tmp_path, world):
    """On 2 and 4 GPUs (NCCL): the step captured on every rank, no fallback message, and validation's forward replayed
    through DDP's wrapping; every item once an epoch, whole-set metrics (those of the uncaptured forward outside DDP), the
    same weights on every rank"""
    if torch.cuda.device_count() < world: pytest.skip(f"FastStep(graph=True) under DDP on {world} GPUs: this machine has {torch.cuda.device_count()}")
    r = _torchrun(tmp_path, '--graph', device='gpu', nproc=world)
    print(ddp_worker.check(tmp_path, world=world))
    assert 'FastStep(graph=True):' not in r.stderr, r.stderr[-3000:]
    assert all(g['n'] >= 1 and g['failed'] is None for g in _ranks(tmp_path, 'graphs', world)), _ranks(tmp_path, 'graphs', world)
    forwards = _ranks(tmp_path, 'forwards', world)  # after each of the fit's two validations
    assert all(len(f) == 2 and {v['model'] for v in f} == {'DistributedDataParallel'} for f in forwards), forwards
    assert all(f[-1]['replays'] > 0 and f[-1]['failed'] is None for f in forwards), forwards


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="FastStep(graph=True) under DDP with BatchNorm: needs 2 GPUs")
def test_graph_with_batchnorm_under_ddp_on_gpus(tmp_path):
    "Captured under DDP with a BatchNorm layer (sync_bn=False): DDP broadcasts nothing at the forwards, every rank validates and ends with rank 0's statistics; exactly-once, whole-set metrics"
    r = _torchrun(tmp_path, '--graph', '--bn', '--no-sync-bn', device='gpu')
    print(ddp_worker.check(tmp_path))
    assert 'FastStep(graph=True):' not in r.stderr, r.stderr[-3000:]
    assert all(g['n'] >= 1 and g['failed'] is None for g in _ranks(tmp_path, 'graphs')), _ranks(tmp_path, 'graphs')
    assert _ranks(tmp_path, 'forward_sync') == [[False, False]]*2
    stats,at_validation = _ranks(tmp_path, 'buffers'),_ranks(tmp_path, 'valid_buffers')
    assert stats[0] == stats[1] and stats[0] != 0, stats
    assert at_validation[0] == at_validation[1] and len(at_validation[0]) == 2, at_validation


@pytest.mark.gpu
@pytest.mark.parametrize('world', [2, 4])
def test_fast_step_races_alike_on_every_rank(tmp_path, world):
    "`FastStep()` under DDP on 2 and 4 GPUs: every rank's race chooses alike (the slowest rank's times), and training stays exactly-once with whole-set metrics"
    if torch.cuda.device_count() < world: pytest.skip(f"FastStep()'s race under DDP on {world} GPUs: this machine has {torch.cuda.device_count()}")
    # 231 items at bs 2: 28 or more batches a rank an epoch, enough for the race (3 untimed, 8 each way, the capture between)
    r = _torchrun(tmp_path, '--fast-step', '--n-train', '231', '--bs', '2', '--race-from', '0', device='gpu', nproc=world)
    print(ddp_worker.check(tmp_path, world=world, n_train=231, bs=2))
    graphs = _ranks(tmp_path, 'graphs', world)
    assert len({g['race'] for g in graphs}) == 1 and graphs[0]['race'] in ('graph', 'eager'), graphs
    assert all((g['n'] >= 1) == (g['race'] == 'graph') for g in graphs), graphs
    assert "FastStep (graph='auto')" not in r.stderr, r.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="FastStep(graph=True) under DDP: needs 2 GPUs (the lead's GPU machine)")
def test_graph_and_eager_train_alike_under_ddp(tmp_path):
    "The captured and the uncaptured fast step, same seeds (model and loader), 2 GPUs: the same validation loss and accuracy after 2 epochs, float rounding apart"
    runs = [_torchrun(tmp_path/'eager', '--eager', '--seed', '3', device='gpu'),
            _torchrun(tmp_path/'graph', '--graph', '--seed', '3', device='gpu')]
    # DaliDistributed made the AccumulateGrad nodes DDP keeps on the step's stream: no backward waits across streams
    assert not any("AccumulateGrad node's stream" in r.stderr for r in runs), runs[0].stderr[-3000:]
    eager,graph = _ranks(tmp_path/'eager', 'ddp_valid')[0],_ranks(tmp_path/'graph', 'ddp_valid')[0]
    assert all(abs(a - b) <= 1e-3*max(1, abs(a)) for a,b in zip(eager, graph)), (eager, graph)
    weights = [_ranks(tmp_path/k, 'weights')[0] for k in ('eager', 'graph')]
    assert abs(weights[0] - weights[1]) <= 1e-4*max(1, abs(weights[0])), f"the same weights after the fit: {weights}"


# ---------------------------------------------------------------- the gradient nodes DDP keeps

def test_ddp_keeps_the_gradient_nodes_made_before_it(group):
    "DDP adopts the AccumulateGrad nodes alive when it is built (those `DaliDistributed` makes on the step's stream), and keeps them"
    m = nn.Linear(4, 2)
    made = distributed.grad_nodes(m)  # held until DDP is built, as `DaliDistributed` holds them
    for node in made: node.metadata['made'] = 'before DDP'
    ddp = DistributedDataParallel(m)  # noqa: F841 (kept alive: it keeps the nodes)
    del made, node
    assert [n.metadata.get('made') for n in distributed.grad_nodes(m)] == ['before DDP']*2
    alone = nn.Linear(4, 2)
    made = distributed.grad_nodes(alone)
    for node in made: node.metadata['made'] = 'before'
    del made, node
    assert [n.metadata.get('made') for n in distributed.grad_nodes(alone)] == [None]*2, "without DDP nothing keeps them"


# ---------------------------------------------------------------- one process: why a DDP model is not captured

@pytest.fixture
def group():
    "A one-process gloo group, as torchrun would start (RANK, WORLD_SIZE), torn down after the test"
    with socket.socket() as s: s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=0, world_size=1)
    try: yield
    finally: dist.destroy_process_group()


class _Learn:
    "What `GraphCapture` reads of a `Learner`: its model, whether its training loader runs the step on a stream of its own"
    def __init__(self, model, priority_stream:bool=True):
        self.model,self.dls = model,SimpleNamespace(train=SimpleNamespace(priority_stream=priority_stream))


def _refusal(model, sync_bn=False, priority_stream=True, **ddp_kwargs)->str:
    "Why `GraphCapture` would not capture `model` wrapped in DDP (checked as its first training batch does)"
    with warnings.catch_warnings(record=True):
        warnings.simplefilter('always')
        cap = GraphCapture(_Learn(model, priority_stream), warnings.warn)  # on the CPU: refused already, which `_ddp_refusal` does not look at
    cap.learn.model = DistributedDataParallel(model, **ddp_kwargs)
    # DDP takes SyncBatchNorm on GPU modules only: made after the wrapping here (`convert_sync_batchnorm` replaces children in place)
    if sync_bn: nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return cap._ddp_refusal()


def test_why_a_ddp_model_is_not_captured(group):
    "The first reason that applies, in words that say what to do"
    assert 'find_unused_parameters=True' in _refusal(nn.Linear(4, 2), find_unused_parameters=True)
    assert 'distrib_ctx(sync_bn=False)' in _refusal(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), sync_bn=True)
    assert 'runs on gloo' in _refusal(nn.Linear(4, 2))
    # fastai's own loaders, or ours with priority_stream=False: the step on the default stream (a capture there failed on
    # 2 x H200, and its fallback died in dropout: "Offset increment outside graph capture")
    assert 'priority_stream=True' in _refusal(nn.Linear(4, 2), priority_stream=False)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter('always')
        cap = GraphCapture(_Learn(nn.Linear(4, 2)), warnings.warn)
    assert cap._ddp_refusal() is None, "not wrapped: nothing DDP's to refuse"


def test_the_module_inside_ddp_is_captured(group):
    "A model the user wrapped in DDP before the fit: the module inside is the one `forward` is put on, so DDP still all-reduces"
    inner = nn.Linear(4, 2)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter('always')
        cap = GraphCapture(_Learn(DistributedDataParallel(inner)), warnings.warn)
    assert cap.model is inner


# ---------------------------------------------------------------- the inference forward through DDP's wrapping

class _WrapsInDDP(Callback):
    "What fastai's DistributedTrainer does to the model for a fit (its Accelerator wraps nothing in a one-process group)"
    order = DistributedTrainer.order
    def before_fit(self): self.learn.model,self.wrapped = DistributedDataParallel(self.learn.model),[]
    def before_validate(self): self.wrapped.append(type(self.learn.model).__name__)
    def after_fit(self): self.learn.model = self.learn.model.module


@needs_gpu("FastStep captures the inference forward on a CUDA device")
def test_validation_through_ddp_replays_the_module_inside(group, tmp_path):
    """A fit's validations under DDP replay the captured forward of the module inside `DistributedDataParallel` (a forward
    with no gradient asks nothing of the other ranks), with the values of the uncaptured forward; `get_preds` after the
    fit, which fastai's callbacks wrap in a new DDP around the same module, replays the same graphs"""
    from test_faststep import small_cnn, _tensor_dls, _eager_validate
    fs,wraps = FastStep(graph=True),_WrapsInDDP()
    learn = Learner(_tensor_dls(), small_cnn(2).cuda(), loss_func=CrossEntropyLossFlat(), metrics=accuracy, path=tmp_path, cbs=[wraps, fs])
    with learn.no_bar(), warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always'); learn.fit(3, 1e-2)
    assert wraps.wrapped == ['DistributedDataParallel']*3
    said = [str(x.message) for x in w if 'inference forward' in str(x.message)]
    assert not said and fs.forwards.replays > 0 and len(fs.forwards.graphs) == 2, (said, fs.forwards.replays)
    recorded = [float(v) for v in learn.recorder.values[-1][1:]]  # the last validation, through DDP, replayed
    assert recorded == pytest.approx(_eager_validate(learn, fs), rel=1e-5, abs=1e-6)
    graphs,replays = {k: g for k,(g,_,_) in fs.forwards.graphs.items()},fs.forwards.replays
    with learn.no_bar(): learn.get_preds()
    kept = {k: g for k,(g,_,_) in fs.forwards.graphs.items()}
    assert fs.forwards.replays > replays and kept.keys() == graphs.keys() and all(kept[k] is graphs[k] for k in graphs), \
        "the graphs captured in the fit, replayed through another DDP"


# ---------------------------------------------------------------- the captured step through DDP's wrapping, one GPU

@pytest.fixture
def nccl_group():
    "A one-process NCCL group on the first GPU, torn down after the test"
    with socket.socket() as s: s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]
    dist.init_process_group('nccl', init_method=f'tcp://127.0.0.1:{port}', rank=0, world_size=1, device_id=torch.device('cuda', 0))
    try: yield
    finally: dist.destroy_process_group()


class _AsFastaiWraps(DistributedTrainer):
    """fastai's DistributedTrainer as `DaliDistributed` and `FastStep` see it (among the callbacks; DDP built at its
    `before_fit`, after theirs), without its Accelerator, which wraps nothing in a one-process group; `ddp`: DDP's arguments"""
    order = DistributedTrainer.order
    def __init__(self, **ddp): self.ddp = ddp
    def before_fit(self): self.learn.model = DistributedDataParallel(self.learn.model, **self.ddp)
    def after_fit(self): self.learn.model = self.learn.model.module
    def before_train(self): pass
    def before_validate(self): pass


@needs_gpu("FastStep(graph=True) captures the step on a CUDA device")
@pytest.mark.parametrize('bucket_view', [False, True], ids=['ddp-default', 'bucket-views'])
def test_step_captured_through_ddp_trains_as_without_it(nccl_group, files, tmp_path, bucket_view):
    """`FastStep(graph=True)` with the model wrapped in DDP as fastai wraps it (NCCL, one process): the step captured whole,
    DDP's all-reduce inside the graph, after DDP's warm-up steps, no fallback (`DaliDistributed` made the gradient nodes DDP
    keeps on the loader's stream: made on the default stream they break the capture), with DDP's buckets copied into or,
    `gradient_as_bucket_view=True`, the gradients themselves; the weights those of the step with no DDP, same batches"""
    from dali_fastai.loader import DaliDataLoader
    from helpers import index_items
    from test_faststep import small_cnn
    def fit(*wrap):
        # 8 batches an epoch, 16 in the fit: the step is captured after DDP's 11 (`DDP_WARMUP`)
        train = DaliDataLoader(index_items(files[:64]), bs=8, size=8, train=True, device='gpu', warp_mode=None, seed=0)
        dls = DaliDataLoaders(train, DaliDataLoader(index_items(files[64:80]), bs=8, size=8, device='gpu'), path=tmp_path, device=train.device)
        rec = ddp_worker.Record()
        learn = Learner(dls, small_cnn(MAX_INDEX).cuda(), loss_func=CrossEntropyLossFlat(), path=tmp_path,
                        cbs=[DaliDistributed(), FastStep(graph=True), rec, *wrap])
        with learn.no_bar(), warnings.catch_warnings(record=True) as w:
            warnings.simplefilter('always'); learn.fit(2, 1e-2)
        said = [str(x.message) for x in w if 'FastStep' in str(x.message) or 'AccumulateGrad' in str(x.message)]
        for dl in dls.loaders: dl.close()
        return torch.cat([p.detach().flatten() for p in learn.model.parameters()]),rec,said
    alone,_,_ = fit()
    wrapped,rec,said = fit(_AsFastaiWraps(gradient_as_bucket_view=bucket_view))
    assert not said and rec.graphs == dict(n=1, failed=None, race=None, whole=True), (said, rec.graphs)
    assert rec.bucket_views is bucket_view and rec.seen['train'][0], "trained through DDP, built as asked"
    assert torch.allclose(wrapped, alone, rtol=1e-4, atol=1e-6), (wrapped - alone).abs().max()


# ---------------------------------------------------------------- the SyncBatchNorm note

class _FakeDDP(DistributedTrainer):
    "fastai's DistributedTrainer as `say_sync_bn` sees it (among the callbacks), without its Accelerator or its wrapping"
    order = DistributedTrainer.order
    def __init__(self): pass
    def before_fit(self): pass
    def after_fit(self): pass
    def before_train(self): pass
    def before_validate(self): pass


class _StopAtTraining(Callback):
    "Stop the fit once the first epoch's training has begun (SyncBatchNorm's forward needs a GPU)"
    order = 99
    def before_train(self): raise CancelFitException


@pytest.mark.parametrize('world,local,said', [(2, 2, True), (1, 1, False), (4, 2, False)], ids=['one-machine', 'one-process', 'two-machines'])
def test_fast_step_fit_with_sync_batchnorm_says_so_once(files, tmp_path, monkeypatch, world, local, said):
    "A FastStep fit starting under DDP with SyncBatchNorm layers: one note, with the measured cost and `sync_bn=False`"
    monkeypatch.setattr(distributed, '_said_sync_bn', [])
    for k,v in dict(RANK='0', WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(local)).items(): monkeypatch.setenv(k, v)
    dls = DaliDataLoaders(index_loader(files[:16], 4, train=True, seed=0, warp_mode=None), index_loader(files[16:24], 4),
                          path=tmp_path, device='cpu')
    model = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.Flatten(), nn.Linear(192, MAX_INDEX), nn.BatchNorm1d(MAX_INDEX)))
    learn = Learner(dls, model, loss_func=CrossEntropyLossFlat(), cbs=[FastStep(), _FakeDDP(), _StopAtTraining()])
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        with learn.no_bar(), learn.no_logging():
            for _ in range(2): learn.fit(1)
    notes = [str(x.message) for x in w if 'SyncBatchNorm' in str(x.message)]
    if not said: assert notes == []; return
    assert len(notes) == 1, "once a process, not once a fit"
    assert '0.74x' in notes[0] and '2026-11-24' in notes[0] and 'learn.distrib_ctx(sync_bn=False)' in notes[0]


# ---------------------------------------------------------------- DDP's gradients as views of its buckets

class _BuildsDDP(_FakeDDP):
    "fastai's DistributedTrainer as `BucketViews` sees it: DDP's arguments read from its accelerator (its `ddp_handler` alone) at its `before_fit`"
    def __init__(self, handler=None): self.accelerator,self.built = SimpleNamespace(ddp_handler=handler),[]
    def before_fit(self):
        h = self.accelerator.ddp_handler
        self.built.append(h.to_kwargs() if h is not None else {})


def _fit_under(tmp_path, files, step:FastStep, handler=None)->tuple:
    "Two fits and a `get_preds` with `step` and DDP built as fastai builds it; what DDP got each time, and the handler after"
    dls = DaliDataLoaders(index_loader(files[:16], 4, train=True, seed=0, warp_mode=None), index_loader(files[16:24], 4),
                          path=tmp_path, device='cpu')
    trainer = _BuildsDDP(handler)
    learn = Learner(dls, nn.Sequential(nn.Flatten(), nn.Linear(192, MAX_INDEX)), loss_func=CrossEntropyLossFlat(),
                    cbs=[step, trainer])
    with learn.no_bar(), learn.no_logging():
        learn.fit(1); learn.get_preds(); learn.fit(1)
    return trainer.built,trainer.accelerator.ddp_handler


@pytest.mark.parametrize('step,views', [(dict(), True), (dict(bucket_view=False), False), (dict(fused=False), False)],
                         ids=['default', 'bucket_view=False', 'fastai-optimizer'])
def test_fast_step_asks_ddp_for_bucket_views_with_its_optimizer_only(files, tmp_path, step, views):
    """`FastStep()` asks fastai's DistributedTrainer for `gradient_as_bucket_view=True` at each fit where its optimizer is
    PyTorch's (not with `bucket_view=False`, nor with fastai's optimizer, whose `zero_grad` refuses views), the
    `get_preds` between them included, and gives the accelerator back as it was once DDP is built"""
    built,after = _fit_under(tmp_path, files, FastStep(graph=False, **step))
    assert built == [{'gradient_as_bucket_view': True} if views else {}]*3, built
    assert after is None, "the accelerator as the user made it"


def test_fast_step_keeps_the_users_ddp_arguments(files, tmp_path):
    "Arguments the user gave DDP (`distrib_ctx(kwargs_handlers=[DistributedDataParallelKwargs(...)])`) are theirs: no views added"
    from accelerate import DistributedDataParallelKwargs
    mine = DistributedDataParallelKwargs(find_unused_parameters=True)
    built,after = _fit_under(tmp_path, files, FastStep(graph=False), handler=mine)
    assert built == [{'find_unused_parameters': True}]*3 and after is mine


# ---------------------------------------------------------------- DaliDistributed's gradient nodes

def test_dali_distributed_holds_the_gradient_nodes_until_ddp_has_them(group, files, tmp_path):
    """`DaliDistributed` makes the parameters' AccumulateGrad nodes before fastai's DistributedTrainer wraps the model (on a
    GPU, on the stream the loader runs the step on), holds them while DDP is built, and lets go once DDP keeps them"""
    class WrapsLikeFastai(_FakeDDP):
        def before_fit(self):
            for node in self.learn.dali_distributed._nodes: node.metadata['made by'] = 'DaliDistributed'
            self.ddp = DistributedDataParallel(self.learn.model)
    dls = DaliDataLoaders(index_loader(files[:16], 4, train=True, seed=0, warp_mode=None), index_loader(files[16:24], 4),
                          path=tmp_path, device='cpu')
    model = nn.Sequential(nn.Flatten(), nn.Linear(192, MAX_INDEX))
    learn = Learner(dls, model, loss_func=CrossEntropyLossFlat(), cbs=[DaliDistributed(), WrapsLikeFastai(), _StopAtTraining()])
    with learn.no_bar(), learn.no_logging(): learn.fit(1)
    assert learn.dali_distributed._nodes is None, "let go at the training's start: DDP keeps them"
    assert [n.metadata.get('made by') for n in distributed.grad_nodes(model)] == ['DaliDistributed']*2


# ---------------------------------------------------------------- the DDP bench (tools/ddp_bench.py; run on GPUs by the lead)

def test_ddp_bench_has_a_graph_row_and_scales_to_every_count(tmp_path, monkeypatch):
    "`--compare N`: every case on 1, 2, 4 ... N GPUs, kept as it goes, one table with a ratio per count; the graph is a row"
    from helpers import load_tool
    ddp = load_tool('ddp_bench')
    extras = [tuple(extra) for _,extra in ddp.CASES]
    assert {('--fast-step', '--graph'), ('--fast-step', '--auto'), ('--synthetic', '--fastai-model', '--graph')} <= set(extras)
    assert [ddp.gpu_counts(n) for n in (1, 2, 4, 6)] == [[1], [1, 2], [1, 2, 4], [1, 2, 4, 6]]
    assert ddp.n_per_class_for(9000, 4)*0.8*len(ddp.BENCH_PHOTOS)/4 >= 9000 and ddp.n_per_class_for(10, 1) == 2000
    runs = []
    monkeypatch.setattr(ddp, 'run_case', lambda n, args: runs.append((n, tuple(args))) or 100.0*n)
    out = tmp_path/'rows.json'
    ddp.compare([1, 2], ['--bs', '8'], 8, out)
    assert len(runs) == 2*len(ddp.CASES) - 1, "sync_bn on one GPU is the row before it"
    ddp.compare([1, 2], ['--bs', '8'], 8, out)
    assert len(runs) == 2*len(ddp.CASES) - 1, "a second run skips the cases kept in --out"
    runs.clear(); ddp.compare([1, 4], ['--bs', '8'], 8, tmp_path/'some.json', cases=[2, 11])
    assert runs == [(1, ('--bs', '8', '--synthetic')), (4, ('--bs', '8', '--synthetic')), (1, ('--bs', '8', '--sync-bn')),
                    (4, ('--bs', '8', '--sync-bn'))], "only the cases asked for; sync_bn on one GPU runs when the row above did not"
    t = ddp.table(json.loads(out.read_text()), [1, 2], 8)
    assert '| img/s, resnet50 bf16, bs 8/GPU | 1 GPU | 2 GPUs | 2 vs 1 |' in t and 'resnet18 bf16' in ddp.table({}, [1], 8, 'resnet18')
    assert '| 1 GPU | 2 GPUs | 2 vs 1 |' in t and '| fastai + dali_fastai + FastStep(graph=True), `distrib_ctx(sync_bn=False)` | 100 | 200 | 2.00x |' in t


def test_ddp_bench_runs_only_the_counts_asked_for(tmp_path, monkeypatch):
    "`--compare 4 --counts 1,4`: the cases on 1 and 4 GPUs only (a 4-GPU machine's device time, without the 2-GPU rows); a count above --compare's is refused"
    from helpers import load_tool
    ddp = load_tool('ddp_bench')
    runs = []
    monkeypatch.setattr(ddp, 'run_case', lambda n, args: runs.append(n) or 1.0)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, 'argv', ['ddp_bench.py', '--compare', '4', '--counts', '4,1', '--cases', '7', '--n-per-class', '4'])
    ddp.main()
    assert runs == [1, 4]
    monkeypatch.setattr(sys, 'argv', ['ddp_bench.py', '--compare', '2', '--counts', '1,4', '--n-per-class', '4'])
    with pytest.raises(SystemExit, match=r'--counts 1,4: each must be 1 to 2'): ddp.main()
    assert runs == [1, 4]


def test_ddp_bench_passes_the_loader_levers_to_every_case(tmp_path, monkeypatch):
    "`--compare` hands `--num-threads`, `--hw-decoder-load`, `--no-priority-stream` and `--no-kept-decoder` to each case, which gives them to its loaders"
    from helpers import load_tool
    ddp = load_tool('ddp_bench')
    runs = []
    monkeypatch.setattr(ddp, 'run_case', lambda n, args: runs.append(tuple(args)) or 1.0)
    monkeypatch.setattr(sys, 'argv', ['ddp_bench.py', '--compare', '1', '--cases', '1', '--num-threads', '3',
                                      '--hw-decoder-load', '1.0', '--no-priority-stream', '--no-kept-decoder',
                                      '--n-per-class', '4', '--out', str(tmp_path/'o.json')])
    ddp.main()
    assert runs == [('--arch', 'resnet50', '--bs', '128', '--size', '224', '--n-per-class', '4', '--epochs', '4', '--num-threads', '3',
                     '--hw-decoder-load', '1.0', '--no-priority-stream', '--no-kept-decoder', '--loader-only')], runs
    seen = {}
    def made(*args, **kwargs): seen.update(kwargs); raise SystemExit  # the loaders' arguments are all this test wants
    monkeypatch.setattr(ddp.DaliDataLoaders, 'from_folder', made)
    monkeypatch.setattr(ddp, 'bench_images', lambda **kw: tmp_path)
    monkeypatch.setattr(ddp.torch.cuda, 'set_device', lambda i: None)
    monkeypatch.setattr(sys, 'argv', ['ddp_bench.py', '--loader-only', '--num-threads', '3', '--hw-decoder-load', '1.0',
                                      '--no-priority-stream'])
    with pytest.raises(SystemExit): ddp.main()
    assert seen['num_threads'] == 3 and seen['priority_stream'] is False and seen['hw_decoder_load'] == 1.0


def test_ddp_bench_every_rank_says_which_rank_and_which_batch(monkeypatch, capsys):
    "`--every-rank-says`: the captures' messages on every rank, each warning naming its rank, each inference-forward capture its batch's shape, each broken one tried again, each collection mid-capture"
    import gc, warnings
    from helpers import load_tool
    from dali_fastai.capture import ForwardCapture
    ddp = load_tool('ddp_bench')
    shown,captured = [],[]
    monkeypatch.setattr(ddp.dali_fastai.capture, 'rank_distrib', lambda: 1)  # rank 1 of a run: says nothing without the probe
    monkeypatch.setattr(warnings, 'showwarning', lambda message, *args, **kwargs: shown.append(str(message)))  # what the probe wraps
    monkeypatch.setattr(ForwardCapture, '_capture', lambda self, xs, key: captured.append(key))  # and this (CUDA's)
    monkeypatch.setattr(ForwardCapture, '_again', lambda self, why: captured.append(why))  # and this
    n = len(gc.callbacks)
    try:
        ddp.every_rank_says(1)
        assert ddp.dali_fastai.capture.rank_distrib() == 0
        warnings.showwarning(UserWarning('FastStep: a capture failed'), UserWarning, 'capture.py', 1)
        ForwardCapture._capture(None, (torch.zeros(40, 3, 8, 8),), 'key')
        ForwardCapture._again(None, 'capturing it failed (...)')
        gc.collect()  # outside a capture: not said
        monkeypatch.setattr(torch.cuda, 'is_current_stream_capturing', lambda: True)
        gc.collect()
    finally: del gc.callbacks[n:]
    assert shown == ['rank 1: FastStep: a capture failed'] and captured == ['key', 'capturing it failed (...)']
    out = capsys.readouterr().out
    assert 'ddp_bench rank 1: capturing it failed (...); tried again at the next forward of that shape' in out
    assert 'ddp_bench rank 1: capturing the inference forward of a (40, 3, 8, 8) batch' in out
    assert out.count('garbage collector') == 1 and 'ddp_bench rank 1: the garbage collector ran (generation 2) during a CUDA graph capture' in out, out


@pytest.mark.skipif(platform.machine() != 'x86_64' or not os.path.exists('/proc/self/task'),
                    reason="threads_now reads Linux's /proc and knows x86-64's system call numbers")
def test_ddp_bench_recapture_captures_every_forward_and_shows_the_threads(monkeypatch, capsys):
    """`--recapture`: each inference forward's graph goes after it (the next forward of that shape captures again), broken
    captures are tried again without end, and a capture's first error prints what the process's other threads are doing;
    a probe of one run, refused with --compare"""
    import threading, time
    from helpers import load_tool
    from dali_fastai.capture import ForwardCapture
    ddp = load_tool('ddp_bench')
    monkeypatch.setattr(ddp, 'run_case', lambda n, args: pytest.fail('a case ran'))
    monkeypatch.setattr(sys, 'argv', ['ddp_bench.py', '--compare', '1', '--recapture'])
    with pytest.raises(SystemExit, match='--recapture is a probe of one run'): ddp.main()
    def forward(self, x): self.graphs['key'] = 'graph'; return x  # a forward that captured
    def eager(self, x): raise RuntimeError('CUDA error: operation failed due to a previous error during capture')
    for k,f in (('forward', forward), ('_eager', eager), ('retries', ForwardCapture.retries)): monkeypatch.setattr(ForwardCapture, k, f)
    ddp.recapture_each(1)
    fc = SimpleNamespace(graphs={})
    assert ForwardCapture.forward(fc, 3) == 3 and fc.graphs == {} and ForwardCapture.retries > 1000
    r,w = os.pipe()
    t = threading.Thread(target=os.read, args=(r, 1), name='reading'); t.start()  # in a system call (read) that is not a wait's
    for _ in range(3000):  # until it is in read (30 s at most: a test never hangs)
        if _syscall(t.native_id).split()[0] == '0': break
        time.sleep(0.01)
    try:
        monkeypatch.setattr(torch.cuda, 'is_current_stream_capturing', lambda: False)
        with pytest.raises(RuntimeError, match='previous error'): ForwardCapture._eager(fc, 3)  # outside a capture: nothing said
        assert 'beside it' not in capsys.readouterr().out
        monkeypatch.setattr(torch.cuda, 'is_current_stream_capturing', lambda: True)
        with pytest.raises(RuntimeError, match='previous error'): ForwardCapture._eager(fc, 3)
    finally: os.write(w, b'x'); t.join(); os.close(r); os.close(w)
    out = capsys.readouterr().out
    assert 'ddp_bench rank 1: a capture failed; beside it:' in out and "(Python thread 'reading') state S, system call 0" in out, out
    assert 'waiting: ' in out

def _syscall(tid:int)->str: return open(f'/proc/self/task/{tid}/syscall').read()


def test_ddp_bench_keeps_ddp_default_for_faststep_cases_only(tmp_path, monkeypatch):
    """`--compare --no-bucket-view`: FastStep's cases get the flag (`FastStep(bucket_view=False)`) and their own file; any
    other case (built with DDP's default already) is refused before a run"""
    from helpers import load_tool
    ddp = load_tool('ddp_bench')
    runs = []
    monkeypatch.setattr(ddp, 'run_case', lambda n, args: runs.append(tuple(args)) or 1.0)
    monkeypatch.chdir(tmp_path)
    for cases in ('1', '7,10', None):
        monkeypatch.setattr(sys, 'argv', ['ddp_bench.py', '--compare', '1', '--no-bucket-view', '--n-per-class', '4', *(['--cases', cases] if cases else [])])
        with pytest.raises(SystemExit, match=r'--cases among 6,7,8,9\)'): ddp.main()
    for case in (['--synthetic', '--graph'], ['--plain-dali'], []):  # one case, no --compare: refused before any work too
        monkeypatch.setattr(sys, 'argv', ['ddp_bench.py', '--no-bucket-view', *case])
        with pytest.raises(SystemExit, match="FastStep's fastai cases only"): ddp.main()
    assert runs == []
    monkeypatch.setattr(sys, 'argv', ['ddp_bench.py', '--compare', '1', '--no-bucket-view', '--n-per-class', '4', '--cases', '7'])
    ddp.main()
    assert runs == [('--arch', 'resnet50', '--bs', '128', '--size', '224', '--n-per-class', '4', '--epochs', '4', '--no-bucket-view',
                     '--fast-step', '--graph')], runs
    assert (tmp_path/'ddp_bench_no_bucket_view.json').exists() and not (tmp_path/'ddp_bench.json').exists(), "not mixed with FastStep's default's rows"


# ---------------------------------------------------------------- BatchNorm's statistics: sent before validation, not each forward

def test_buffers_go_to_the_ranks_before_validation_not_at_every_forward(group):
    "`BuffersAtValidation` turns DDP's broadcast at every forward off, sends the buffers when asked, and gives DDP its own back at the fit's end"
    ddp = DistributedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    b = distributed.BuffersAtValidation(ddp)
    assert b.ddp is ddp and not ddp.broadcast_buffers
    ddp(torch.randn(8, 4))  # the forward no longer sends them
    b.send()
    b.restore()
    assert ddp.broadcast_buffers and b.ddp is None
    failed = distributed.BuffersAtValidation(ddp)
    failed.restore(send=False)  # after a fit that raised: no collective, DDP's own broadcast back
    assert ddp.broadcast_buffers and failed.ddp is None
    assert distributed.BuffersAtValidation(DistributedDataParallel(nn.Linear(4, 2))).ddp is None, "no buffers: nothing to send"
    assert distributed.BuffersAtValidation(nn.BatchNorm1d(4)).ddp is None, "not under DDP: nothing to do"
