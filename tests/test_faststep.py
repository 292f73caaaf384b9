"""`FastStep` with the rest of fastai's Learner API, on dali_fastai's loaders (DALI's CPU backend) and fastai's own.

Each test asserts what would break if `FastStep` got in the way: the API runs, and its result is what fastai's gives."""
import threading
import warnings
from functools import partial
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from fastai.callback.core import Callback, CancelFitException
from fastai.callback.schedule import fit_one_cycle, fit_flat_cos, lr_find, fine_tune  # noqa: F401 (add them to Learner)
from fastai.callback.fp16 import to_bf16, to_fp16  # noqa: F401 (add them to Learner)
from fastai.callback.training import GradientAccumulation
from fastai.learner import Learner, load_learner
from fastai.losses import CrossEntropyLossFlat
from fastai.metrics import accuracy
from fastai.optimizer import Adam, Optimizer, SGD, RMSProp
from fastai.vision.learner import vision_learner

from dali_fastai import capture
from dali_fastai.all import *
from dali_fastai.fastopt import FastOptimizer, torch_step
from dali_fastai.capture import ForwardCapture
from dali_fastai.faststep import FastStep
from helpers import fmnist_path, fmnist_subset, needs_gpu
from test_distributed import _learner

SIZE = 28


def make_dls():
    "200 Fashion-MNIST images (20 a class), split 160/40, bs 16: the same batches in the same order for each new one"
    files,labels = fmnist_subset(20)
    return DaliDataLoaders.from_lists(fmnist_path(), files, labels, valid_pct=0.2, seed=0, bs=16, size=SIZE, device='cpu')


@pytest.fixture
def dls(): return make_dls()


def small_cnn(c=10):
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, stride=2), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, stride=2), nn.BatchNorm2d(8),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, c))


def learner(dls, tmp_path, fast=True, cbs=()):
    return Learner(dls, small_cnn(dls.c), loss_func=CrossEntropyLossFlat(), metrics=accuracy, path=tmp_path,
                   cbs=[*cbs, *([FastStep()] if fast else [])])


def quiet(learn): return learn.no_bar()


def test_fit_records_what_fastai_records(dls, tmp_path):
    "Same batches, same schedule: the recorded losses and accuracy agree with fastai's to float rounding"
    a,b = learner(make_dls(), tmp_path, fast=False),learner(make_dls(), tmp_path)
    for l in (a, b):
        with quiet(l): l.fit_one_cycle(2, 1e-2)
    assert type(b.opt) is FastOptimizer
    for x,y in zip(a.recorder.values, b.recorder.values):
        assert all(abs(float(u) - float(v)) < 1e-3 for u,v in zip(x, y)), (x, y)


def test_lr_find_and_fit_flat_cos(dls, tmp_path):
    learn = learner(dls, tmp_path)
    with quiet(learn):
        res = learn.lr_find(num_it=12, show_plot=False)
        assert res.valley > 0
        learn.fit_flat_cos(1, 1e-2)
    assert len(learn.recorder.values) == 1
    assert all(l.device.type == 'cpu' for l in learn.recorder.losses)


def test_fine_tune_freezes_and_unfreezes_with_the_fused_step(dls, tmp_path):
    "vision_learner's groups: the frozen body does not move in the frozen epoch; everything trains after unfreeze"
    from torchvision.models import resnet18
    learn = vision_learner(dls, resnet18, pretrained=False, metrics=accuracy, path=tmp_path, cbs=FastStep())
    body = [p.detach().clone() for p in learn.model[0].parameters() if p.dim() > 1][:3]
    with quiet(learn): learn.fine_tune(1, freeze_epochs=1)
    assert type(learn.opt) is FastOptimizer and len(learn.opt.param_lists) == 3
    assert len(learn.recorder.values) == 1  # the second fit's record
    now = [p for p in learn.model[0].parameters() if p.dim() > 1][:3]
    assert any(not torch.equal(a, b) for a,b in zip(body, now)), "the unfrozen body trained"
    assert {len(h) for h in learn.opt.hypers} == {len(learn.opt.hypers[0])}


def test_save_load_with_the_optimizer_interchangeable_with_fastais(dls, tmp_path):
    a = learner(dls, tmp_path)
    with quiet(a): a.fit(1, 1e-2)
    a.save('fast')
    b = learner(dls, tmp_path, fast=False)
    b.load('fast')  # fastai's own Adam reads FastStep's optimizer state
    assert type(b.opt).__name__ == 'Optimizer'
    pa,pb = next(a.model.parameters()),next(b.model.parameters())
    assert torch.equal(pa, pb)
    assert torch.equal(a.opt.state_dict()['state'][0]['grad_avg'], b.opt.state[b.opt.param_lists[0][0]]['grad_avg'])
    with quiet(b): b.fit(1, 1e-2)
    b.save('slow')
    c = learner(dls, tmp_path)
    with quiet(c): c.fit(1, 1e-2)  # converts c.opt
    c.load('slow')
    assert type(c.opt) is FastOptimizer and c.opt.state_dict()['state'][0]['step'] == 2*len(dls.train)


def test_get_preds_tta_show_results_export(dls, tmp_path):
    learn = learner(dls, tmp_path)
    with quiet(learn): assert len(learn.validate()) == 2  # before any fit
    with quiet(learn): learn.fit(1, 1e-2)
    preds,targs = learn.get_preds()
    assert preds.shape == (40, dls.c) and targs.shape == (40,)
    with quiet(learn): tpreds,_ = learn.tta(n=2)
    assert tpreds.shape == preds.shape
    learn.show_results(max_n=2)
    learn.export(tmp_path/'model.pkl')
    again = load_learner(tmp_path/'model.pkl')
    assert any(isinstance(cb, FastStep) for cb in again.cbs)
    x = dls.valid.one_batch()[0][:1]
    with torch.no_grad(): assert torch.allclose(again.model.eval()(x), learn.model.eval()(x), atol=1e-5)


def test_gradient_accumulation_and_bf16(dls, tmp_path):
    learn = learner(dls, tmp_path, cbs=[GradientAccumulation(n_acc=32)])
    w = next(learn.model.parameters()).detach().clone()
    with quiet(learn): learn.fit(1, 1e-2)
    assert not torch.equal(w, next(learn.model.parameters()))
    if torch.cuda.is_available():  # MixedPrecision is CUDA's autocast: on the GPU machine (`make gpu-test` runs this file there)
        for half in ('to_bf16', 'to_fp16'):  # fp16: PyTorch's GradScaler reads its overflow flag on the host each step
            b = getattr(learner(dls, tmp_path), half)()
            w = next(b.model.parameters()).detach().clone()
            with quiet(b): b.fit(1, 1e-2)
            assert type(b.opt) is FastOptimizer and not torch.equal(w, next(b.model.parameters())), half


def _ckpt_learner(files, path, *cbs): return _learner(files, path, FastStep(), *cbs)  # test_distributed's, with FastStep


def test_dali_checkpoint_resume_ends_with_the_same_weights(files, tmp_path):
    "Stopped after epoch 1's third batch and resumed from `learn.save`: the same weights as the uninterrupted fit"
    from fastai.callback.core import Callback
    class Stop(Callback):
        def after_batch(self):
            if self.training and self.epoch == 1 and self.iter == 2: self.learn.save('ckpt'); raise CancelFitException
    a = _ckpt_learner(files, tmp_path)
    with a.no_bar(), a.no_logging(): a.fit_one_cycle(3, 1e-2)
    b = _ckpt_learner(files, tmp_path, Stop())
    with b.no_bar(), b.no_logging(): b.fit_one_cycle(3, 1e-2)
    c = _ckpt_learner(files, tmp_path)
    c.load('ckpt')
    with c.no_bar(), c.no_logging(): c.fit_one_cycle(3, 1e-2)
    for p,q in zip(a.model.parameters(), c.model.parameters()): assert torch.allclose(p, q, atol=1e-6)


def test_collector_skips_the_objects_alive_at_the_fit_start(dls, tmp_path):
    "During training Python's collector passes over the fit's own objects (gc.freeze), after the fit over all again; a fit stopped by an error leaves them frozen until the next fit or get_preds ends; get_preds freezes nothing"
    import gc
    from fastai.callback.core import Callback
    class Seen(Callback):
        def after_batch(self):
            self.learn.frozen = gc.get_freeze_count()
            if getattr(self.learn, 'fail', False): raise RuntimeError('stop')
    learn = learner(dls, tmp_path, cbs=[Seen()])
    gc.freeze() # other code's frozen objects: Python has one frozen generation, let go with the fit's
    with quiet(learn): learn.fit(1)
    assert learn.frozen > 10_000 and gc.get_freeze_count() == 0
    learn.fail = True
    with quiet(learn), pytest.raises(RuntimeError, match='stop'): learn.fit(1)
    assert gc.get_freeze_count() > 0 # fastai calls no after_fit on an error
    learn.fail = False
    learn.get_preds() # another call's end lets them go
    assert gc.get_freeze_count() == 0
    gc.freeze(); n = gc.get_freeze_count()
    learn.get_preds(); learn.validate() # no training: nothing frozen, nothing let go
    assert gc.get_freeze_count() > n - 10_000; gc.unfreeze() # (frozen objects that are dropped leave the count)
    slow = learner(make_dls(), tmp_path, fast=False, cbs=[Seen(), FastStep(freeze_gc=False)])
    with quiet(slow): slow.fit(1)
    assert slow.frozen == 0

def test_fastai_own_loaders(tmp_path):
    "FastStep works with fastai's DataLoaders too"
    from fastai.data.core import DataLoaders
    xs = torch.randn(48, 3, 16, 16); ys = (xs.mean((1, 2, 3)) > 0).long()
    ds = list(zip(xs, ys))
    d = DataLoaders.from_dsets(ds[:32], ds[32:], bs=8, device='cpu')
    learn = Learner(d, small_cnn(2), loss_func=CrossEntropyLossFlat(), metrics=accuracy, cbs=FastStep(), path=tmp_path)
    with learn.no_bar(): learn.fit(2, 1e-2)
    assert len(learn.recorder.values) == 2 and type(learn.opt) is FastOptimizer


def test_the_training_loss_is_a_plain_tensor(dls, tmp_path):
    "fastai's loss classes return a `TensorBase`, whose every op runs through Python: FastStep hands on a plain tensor in training"
    from fastai.callback.core import Callback
    class Seen(Callback):
        order = 50
        def before_fit(self): self.types = set()
        def after_loss(self): self.types.add((self.training, type(self.loss_grad).__name__, type(self.loss).__name__))
    seen = Seen()
    learn = learner(dls, tmp_path, cbs=[seen])
    with quiet(learn): learn.fit(1, 1e-2)
    assert seen.types == {(True, 'Tensor', 'Tensor'), (False, 'TensorBase', 'TensorBase')}, seen.types


def test_metrics_are_put_back_without_a_gather_across_ranks(dls, tmp_path, monkeypatch):
    "The device metrics gathered across ranks as they accumulated (`learn.to_detach`); putting their values back after the fit gathers nothing more: under NCCL a gather of the host tensors among them fails ('No backend type associated with device type cpu', seen on 2 H100s)"
    import dali_fastai.faststep as fs
    gathers,real = [],fs.to_detach
    def spy(b, cpu=True, gather=True): gathers.append(gather); return real(b, cpu=cpu, gather=gather)
    monkeypatch.setattr(fs, 'to_detach', spy)
    learn = learner(dls, tmp_path)
    with quiet(learn): learn.fit(1)
    with quiet(learn): learn.get_preds()
    assert gathers and not any(gathers)



# fastai's optimizer, group by group and step by step (issue 41: promises no test held)

def _split_cnn(m): return [list(m[:5].parameters()), list(m[5:].parameters())]  # small_cnn's body, head


def test_each_parameter_group_trains_at_its_own_rate(tmp_path):
    "lr=slice(1e-5, 1e-2) after unfreeze (fine_tune's discriminative rates): each group moves as fastai moves it, the body ~1000x less than the head"
    def moves(fast):
        learn = Learner(make_dls(), small_cnn(10), loss_func=CrossEntropyLossFlat(), splitter=_split_cnn, path=tmp_path,
                        cbs=[FastStep()] if fast else [])
        learn.freeze(); learn.unfreeze()  # as fine_tune does before its second fit
        start = [[p.detach().clone() for p in g] for g in _split_cnn(learn.model)]
        with quiet(learn): learn.fit(1, slice(1e-5, 1e-2))
        assert type(learn.opt) is (FastOptimizer if fast else Optimizer)
        return [max((p - s).abs().max().item() for p,s in zip(g, gs)) for g,gs in zip(_split_cnn(learn.model), start)]
    (body,head),(fbody,fhead) = moves(False),moves(True)
    assert head > 100*body, (body, head)
    assert fbody == pytest.approx(body, rel=0.1) and fhead == pytest.approx(head, rel=0.1), ((body, head), (fbody, fhead))


def _step_on(m, opt, seeds):
    for i in seeds:
        x = torch.randn(8, 3, 12, 12, generator=torch.Generator().manual_seed(i))
        nn.functional.cross_entropy(m(x), torch.arange(8) % 3).backward()
        opt.step(); opt.zero_grad()


def test_clear_state_empties_the_moments_as_fastai_s():
    "opt.clear_state() drops Adam's moments and step count (keeping the weight-decay flags): the next step starts them afresh, as fastai's does"
    from fastai.torch_core import norm_bias_params
    res = []
    for fast in (False, True):
        m = small_cnn(3)
        opt = Adam(_split_cnn(m), lr=1e-2)
        for p in norm_bias_params(m): opt.state[p]['do_wd'] = False
        if fast: opt = FastOptimizer.from_fastai(opt, torch_step(opt))
        _step_on(m, opt, range(3))
        opt.clear_state()
        if fast: assert all(set(s) <= {'do_wd'} for s in opt.state_dict()['state']) and opt.state_dict()['state'][1] == {'do_wd': False}
        before = torch.cat([p.detach().flatten() for p in m.parameters()])
        _step_on(m, opt, [3])
        res.append(torch.cat([p.detach().flatten() for p in m.parameters()]) - before)  # the step after clear_state
    assert opt.state_dict()['state'][0]['step'] == 1
    assert (res[1] - res[0]).abs().max() < 0.01*res[0].abs().max()  # Adam's rounding: ~1e-3 of its moves after a few steps


@pytest.mark.parametrize('opt_func', [Adam, partial(Adam, decouple_wd=False), partial(SGD, mom=0.9), SGD, RMSProp])
def test_a_parameter_without_a_gradient_steps_as_fastai_s(opt_func):
    "fastai zeroes gradients in place: a branch used only in the first of 4 steps goes on moving (momentum, weight decay); FastOptimizer moves it the same"
    def branch(fast):
        torch.manual_seed(0)
        a,b = nn.Linear(4, 2),nn.Linear(4, 2)
        opt = opt_func([list(a.parameters()) + list(b.parameters())], lr=1e-2, wd=0.1)
        if fast: opt = FastOptimizer.from_fastai(opt, torch_step(opt))
        seen = []
        for i in range(4):
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(i))
            (a(x) + (b(x) if i == 0 else 0)).pow(2).mean().backward()
            opt.step(); opt.zero_grad()
            seen.append(torch.cat([p.detach().flatten() for p in b.parameters()]))
        return seen
    slow,fast = branch(False),branch(True)
    later = (slow[-1] - slow[0]).abs().max()
    assert later > 1e-4, "fastai moves the branch after its last gradient"
    for i,(p,q) in enumerate(zip(fast, slow)): assert (p - q).abs().max() <= 1e-3*later, (i, p, q)


@pytest.mark.parametrize('opt_func,only_wd', [(Adam, True), (partial(Adam, decouple_wd=False), False), (partial(SGD, mom=0.9), True),
                                              (SGD, True), (RMSProp, True)])
@pytest.mark.parametrize('wd_bn_bias', [False, True])
def test_weight_decay_spares_norm_layers_and_biases_as_fastai_s(opt_func, only_wd, wd_bn_bias, tmp_path):
    """With zero gradients only the weight decay moves a parameter: the Learner's flags (`wd_bn_bias=False`: none on norm
    layers and biases) reach FastOptimizer, which decays the parameters fastai decays (`only_wd`: by exactly 1 - lr*wd)"""
    from fastai.torch_core import norm_bias_params
    res = []
    for fast in (False, True):
        learn = Learner(make_dls(), small_cnn(10), loss_func=CrossEntropyLossFlat(), opt_func=opt_func, wd_bn_bias=wd_bn_bias, path=tmp_path)
        learn.create_opt(); learn.opt.set_hypers(lr=0.1, wd=0.5)  # as fit sets them
        opt = FastOptimizer.from_fastai(learn.opt, torch_step(learn.opt)) if fast else learn.opt
        start = [p.detach().clone() for p in learn.model.parameters()]
        for p in learn.model.parameters(): p.grad = torch.zeros_like(p)
        opt.step()
        res.append([p.detach() for p in learn.model.parameters()])
    spared = {id(p) for p in norm_bias_params(learn.model)} if not wd_bn_bias else set()
    assert len(spared) == (0 if wd_bn_bias else 7)  # two BatchNorm layers' weights and biases, two convolutions' and the linear's biases
    for p,a,b,s in zip(learn.model.parameters(), *res, start):
        assert torch.allclose(b, a, atol=1e-6)
        if id(p) in spared: assert torch.equal(a, s)
        elif only_wd: assert torch.allclose(a, s*(1 - 0.1*0.5), atol=1e-7)
        elif s.any(): assert not torch.equal(a, s)  # L2: the decay enters Adam's moments


def _predicted_share(preds, targs): # an asymmetric metric of fastai's argument order: (preds, targs)
    "The share of the items predicted as the first class among those whose target is not"
    return ((preds == 0) & (targs != 0)).float().sum() / (targs != 0).sum()

def test_device_metrics_call_fastai_s_argument_order(tmp_path):
    """Metrics accumulated on the device are called as fastai calls them: scikit-learn's Precision and Recall with
    (targets, predictions) (`invert_arg=True`), an AccumMetric of (predictions, targets) as it is; each records fastai's value"""
    from fastai.metrics import AccumMetric, Precision, Recall, RocAuc
    def fit(device_metrics):
        ms = [Precision(average='macro'), Recall(average='macro'), RocAuc(),
              AccumMetric(_predicted_share, dim_argmax=-1)]
        learn = Learner(make_dls(), small_cnn(10), loss_func=CrossEntropyLossFlat(), metrics=ms, path=tmp_path,
                        cbs=[FastStep(fused=False, device_metrics=device_metrics)])  # fastai's own optimizer: the same weights
        with quiet(learn): learn.fit(2, 1e-2)
        return [float(v) for v in learn.recorder.values[-1][2:]]
    want,got = fit(False),fit(True)
    precision,recall,_,share = want
    assert abs(precision - recall) > 0.01 and share > 0, want  # the order matters for these values
    assert got == pytest.approx(want, abs=1e-6), (got, want)


@needs_gpu('FastStep(graph=True) captures on a CUDA device')
def test_the_capture_s_warm_up_leaves_the_buffers_as_they_were(tmp_path):
    """make_graphed_callables runs warm-up passes before it captures: GraphCapture puts the buffers back, so after the first
    (captured) batch the BatchNorm statistics and batch counts are those one uncaptured batch leaves"""
    from fastai.callback.core import Callback
    from fastai.data.core import DataLoaders
    from fastai.data.load import DataLoader
    class FirstBatch(Callback):
        def after_batch(self):
            if self.training: raise CancelFitException
    g = torch.Generator().manual_seed(0)
    ds = list(zip(torch.randn(32, 3, 16, 16, generator=g), torch.randint(0, 2, (32,), generator=g)))
    def buffers(graph):
        dls = DataLoaders(DataLoader(ds[:16], bs=8), DataLoader(ds[16:], bs=8))  # no shuffle: the same first batch
        learn = Learner(dls, small_cnn(2).cuda(), loss_func=CrossEntropyLossFlat(), path=tmp_path, cbs=[FastStep(graph=graph), FirstBatch()])
        start = {k: v.clone() for k,v in learn.model.named_buffers()}
        with quiet(learn), warnings.catch_warnings(record=True) as w:
            warnings.simplefilter('always'); learn.fit(1, 1e-2)
        assert not [x for x in w if 'FastStep(graph=True)' in str(x.message)]  # a refused or failed capture warns
        return start,{k: v.detach().clone() for k,v in learn.model.named_buffers()}
    (start,eager),(_,captured) = buffers(False),buffers(True)
    assert eager.keys() == captured.keys() and any('running_mean' in k for k in eager)
    for k in eager:
        if 'num_batches_tracked' in k: assert eager[k].item() == captured[k].item() == start[k].item() + 1, k
        else: assert not torch.equal(eager[k], start[k]) and torch.allclose(captured[k], eager[k], rtol=1e-4, atol=1e-6), k


class _HostRead(nn.Module):
    "Reads a value on the host in its forward: no CUDA graph can hold it (the capture fails there)"
    def forward(self, x): return -x if x.abs().sum().item() < 0 else x


def _reads_on_the_host(): raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nSearch for ...")

def test_a_failed_capture_names_the_error_that_broke_it():
    "`capture_end`'s own error hides the one it was raised while handling: both are said, that one first, with its line of code"
    from dali_fastai.capture import _failure
    try:
        try: _reads_on_the_host()
        finally: raise RuntimeError("CUDA error: operation failed due to a previous error during capture\nSearch for ...")
    except RuntimeError as e: said = _failure(e)
    assert said.startswith('RuntimeError: CUDA error: operation not permitted when stream is capturing (at test_faststep.py:'), said
    assert said.endswith(' in _reads_on_the_host); then RuntimeError: CUDA error: operation failed due to a previous error during capture'), said


@needs_gpu('FastStep(graph=True) captures on a CUDA device')
def test_a_failed_capture_trains_on_uncaptured_dropout_included(tmp_path):
    """A capture that fails says so once and the fit goes on uncaptured: dropout's random numbers too (the failed capture
    left CUDA's generator in capture mode, "Offset increment outside graph capture", until `GraphCapture` reset it), on
    the stream it ran on before"""
    from fastai.data.core import DataLoaders
    from fastai.data.load import DataLoader
    g = torch.Generator().manual_seed(0)
    ds = list(zip(torch.randn(32, 3, 16, 16, generator=g), torch.randint(0, 2, (32,), generator=g)))
    dls = DataLoaders(DataLoader(ds[:24], bs=8), DataLoader(ds[24:], bs=8))
    model = nn.Sequential(small_cnn(2), nn.Dropout(0.5), _HostRead()).cuda()
    learn = Learner(dls, model, loss_func=CrossEntropyLossFlat(), path=tmp_path, cbs=FastStep(graph=True))
    with quiet(learn), warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always'); learn.fit(2, 1e-2)
    said = [str(x.message) for x in w if 'FastStep(graph=True)' in str(x.message)]
    # the step captured whole fails at the host read, then the model's own capture does
    assert len(said) == 2 and 'capturing the step failed' in said[0] and 'capturing the model failed' in said[1], said
    assert "the model's forward and backward are captured instead" in said[0] and 'uncaptured fast step' in said[1], said
    assert '(at test_faststep.py:' in said[0] and 'in forward)' in said[0], f"the host read's line is named: {said[0]}"
    assert len(learn.recorder.losses) == 6 and all(torch.isfinite(l) for l in learn.recorder.losses)
    assert torch.nn.functional.dropout(torch.ones(8, device='cuda'), 0.5).isfinite().all()  # the generator works after the fit
    assert torch.cuda.current_stream() == torch.cuda.default_stream()  # not the failed capture's stream (fastai's loaders set none)


class _HostReadInEval(nn.Module):
    "Reads a value on the host in eval mode only: the training step can be one graph, the inference forward cannot"
    def forward(self, x): return x if self.training or x.abs().sum().item() >= 0 else -x

@needs_gpu('FastStep(graph=True) captures on a CUDA device')
def test_a_failed_capture_leaves_the_graphs_captured_before_replaying(tmp_path):
    """The inference forward's capture failing after the step was captured whole leaves the step's graph replaying in the
    next epochs: the failed capture left the generator state both graphs hold in capture mode ("Offset increment outside
    graph capture encountered unexpectedly" at the next replay, seen on one of 2 H200s), until `GraphCapture` ended it"""
    from fastai.data.core import DataLoaders
    from fastai.data.load import DataLoader
    g = torch.Generator().manual_seed(0)
    ds = list(zip(torch.randn(48, 3, 16, 16, generator=g), torch.randint(0, 2, (48,), generator=g)))
    dls = DataLoaders(DataLoader(ds[:32], bs=8), DataLoader(ds[32:], bs=8))  # 4 training batches, 2 validation ones of one shape
    seen = _Whole()
    model = nn.Sequential(small_cnn(2), nn.Dropout(0.5), _HostReadInEval()).cuda()
    learn = Learner(dls, model, loss_func=CrossEntropyLossFlat(), path=tmp_path, cbs=[FastStep(graph=True), seen])
    with quiet(learn), warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always'); learn.fit(3, 1e-2)
    said = [str(x.message) for x in w if 'FastStep' in str(x.message)]
    assert len(said) == 1 and "capturing the model's inference forward failed" in said[0], said  # at validation's second batch
    # captured at the 4th batch, then every training batch replayed
    assert seen.seen == [dict(whole=True, graphs=1, uncaptured=WHOLE_WARMUP, failed=None)]*3, seen.seen
    assert len(learn.recorder.losses) == 12 and all(torch.isfinite(l) for l in learn.recorder.losses)
    assert torch.nn.functional.dropout(torch.ones(8, device='cuda'), 0.5).isfinite().all()


# ---------------------------------------------------------------- the step captured whole, or the model alone

def test_what_keeps_the_step_from_one_graph_is_named(tmp_path):
    """The forward, the loss and the backward are one graph with fastai's or PyTorch's loss classes and callbacks known to
    work around it; a loss function of another kind (MixUp's, a lambda), fp16's loss scaling or a callback between the
    forward and the optimizer (GradientAccumulation) is named, and then the model alone is captured"""
    from fastai.callback.fp16 import MixedPrecision
    from fastai.callback.mixup import MixUp
    from fastai.callback.training import GradientClip
    from dali_fastai.capture import whole_refusal
    def why(loss_func=CrossEntropyLossFlat(), cbs=()):
        learn = Learner(make_dls(), small_cnn(), loss_func=loss_func, path=tmp_path, cbs=[FastStep(), *cbs])
        return whole_refusal(learn, allowed=(FastStep,))
    assert why() is None and why(nn.CrossEntropyLoss()) is None
    assert why(cbs=[MixedPrecision(amp_mode='bf16'), GradientClip()]) is None
    assert why(cbs=[MixedPrecision()]) == "fp16's loss scaling (GradScaler) runs outside the step"
    assert why(cbs=[GradientAccumulation(8)]) == 'GradientAccumulation runs at after_loss, before_step, between the forward and the optimizer'
    assert 'loss function (MixHandler.lf)' in why(MixUp().lf) and '<lambda>) is not one of' in why(lambda p,y: p.sum())
    learn = Learner(make_dls(), small_cnn(), loss_func=CrossEntropyLossFlat(), path=tmp_path, cbs=[FastStep()])
    assert 'FastStep runs at after_pred, after_loss, before_backward' in whole_refusal(learn), "FastStep's own events are allowed by FastStep only"


def test_the_optimizer_leaves_the_gradients_a_whole_step_graph_writes(dls, tmp_path):
    "`FastOptimizer.keep_grads`: while a whole-step graph writes the gradients at each replay, `zero_grad` leaves them where they are"
    learn = learner(dls, tmp_path)
    learn.create_opt(); learn.opt = FastOptimizer.from_fastai(learn.opt, torch_step(learn.opt))
    for p in learn.model.parameters(): p.grad = torch.ones_like(p)
    grads = [p.grad for p in learn.model.parameters()]
    learn.opt.keep_grads = True; learn.opt.zero_grad()
    assert all(p.grad is g for p,g in zip(learn.model.parameters(), grads))
    learn.opt.keep_grads = False; learn.opt.zero_grad()
    assert all(p.grad is None for p in learn.model.parameters())


def test_a_replayed_step_s_loss_is_given_by_the_loss_function_until_after_loss(dls, tmp_path):
    """From `after_pred` to `after_loss` of a replayed whole step, fastai's loss function gives the graph's loss (fastai
    computes no loss again); fastai's is back at `after_loss`, and at the next fit where a batch stopped in between"""
    from types import SimpleNamespace
    learn = learner(dls, tmp_path)
    fs,lf,loss = learn.fast_step,learn.loss_func,torch.tensor(0.5)
    fs.capture = SimpleNamespace(step_loss=loss)
    learn.training = True
    fs.after_pred(); fs.after_pred() # a batch cancelled after its forward lent it too: fastai's is still the one kept
    assert learn.loss_func(torch.zeros(2, 10), torch.zeros(2)) is loss
    fs.after_loss()
    assert learn.loss_func is lf
    fs.after_pred(); fs.capture = None
    fs.before_fit()
    assert learn.loss_func is lf
    fs.capture = SimpleNamespace(step_loss=None); fs.after_pred()
    assert learn.loss_func is lf, "a batch not replayed whole computes fastai's loss"


class _Counted(CrossEntropyLossFlat):
    "fastai's loss class, counting the training batches it computes a loss for"
    calls = 0
    def __call__(self, *args, **kwargs):
        _Counted.calls += torch.is_grad_enabled()
        return super().__call__(*args, **kwargs)


class _Whole(Callback):
    "What `FastStep`'s `GraphCapture` did by the end of each training pass (read before `after_fit` lets it go)"
    order = FastStep.order + 1
    def before_fit(self): self.seen = []
    def after_train(self):
        cap = self.learn.fast_step.capture
        if cap is not None: self.seen.append(dict(whole=cap.whole, graphs=len(cap.graphs), uncaptured=cap.uncaptured, failed=cap.failed))


@needs_gpu('FastStep(graph=True) captures on a CUDA device')
@pytest.mark.parametrize('amp', [None, 'bf16'])
def test_the_step_captured_whole_trains_as_the_uncaptured_step(tmp_path, amp):
    """The forward, the loss and the backward replayed as one graph after `WHOLE_WARMUP` uncaptured batches, the last
    batch (another shape) uncaptured with its gradients from zero: the weights and the recorded losses are those of the
    uncaptured step, with and without bf16's autocast"""
    from fastai.data.core import DataLoaders
    from fastai.data.load import DataLoader
    from dali_fastai.capture import WHOLE_WARMUP
    g = torch.Generator().manual_seed(0)
    ds = list(zip(torch.randn(50, 3, 16, 16, generator=g), torch.randint(0, 2, (50,), generator=g)))
    def fit(graph):
        dls = DataLoaders(DataLoader(ds[:42], bs=4), DataLoader(ds[42:], bs=4))  # no shuffle: the same batches; the 11th has 2
        seen = _Whole()
        learn = Learner(dls, small_cnn(2).cuda(), loss_func=_Counted(), path=tmp_path, cbs=[FastStep(graph=graph), seen])
        if amp: learn.to_bf16()
        _Counted.calls = 0
        with quiet(learn), warnings.catch_warnings(record=True) as w:
            warnings.simplefilter('always'); learn.fit(2, 1e-2)
        assert not [x for x in w if 'FastStep' in str(x.message)], [str(x.message) for x in w]
        assert isinstance(learn.loss_func, _Counted)
        return torch.cat([p.detach().flatten() for p in learn.model.parameters()]),torch.stack(learn.recorder.losses).float().cpu(),seen.seen
    (eager,eager_losses,_),eager_calls = fit(False),_Counted.calls
    (whole,losses,seen),calls = fit(True),_Counted.calls
    # 3 uncaptured to warm up, then the 11th batch of each epoch (2 images)
    assert seen == [dict(whole=True, graphs=1, uncaptured=WHOLE_WARMUP + 1, failed=None), dict(whole=True, graphs=1, uncaptured=WHOLE_WARMUP + 2, failed=None)], seen
    # fastai's loss function computes the uncaptured batches' losses and the capture's; a replay's is the graph's
    assert (eager_calls, calls) == (22, WHOLE_WARMUP + 2 + 1), (eager_calls, calls)
    assert torch.allclose(whole, eager, rtol=1e-3, atol=1e-4), (whole - eager).abs().max()
    assert torch.allclose(losses, eager_losses, rtol=1e-3, atol=1e-4)


@needs_gpu('FastStep(graph=True) captures on a CUDA device')
@pytest.mark.parametrize('case', ['accumulation', "fastai's optimizer, the model's graph", "fastai's optimizer, the step's graph"])
def test_gradients_that_add_up_train_as_uncaptured(tmp_path, case):
    """Where gradients are added to between backwards, the captured step trains as the uncaptured one: GradientAccumulation
    (the step is not one graph: the model's forward and backward are captured) and fastai's own optimizer (it zeroes them in
    place: a parameter must not take the replayed backward's buffer as its gradient, which the next replay overwrites)"""
    from fastai.data.core import DataLoaders
    from fastai.data.load import DataLoader
    g = torch.Generator().manual_seed(0)
    ds = list(zip(torch.randn(48, 3, 16, 16, generator=g), torch.randint(0, 2, (48,), generator=g)))
    accumulate,fastai_opt = case == 'accumulation',case.startswith("fastai's")
    def fit(graph):
        dls = DataLoaders(DataLoader(ds[:40], bs=4), DataLoader(ds[40:], bs=4))
        seen = _Whole()
        fs = FastStep(graph=graph, fused=not fastai_opt, whole_step=case != "fastai's optimizer, the model's graph")
        learn = Learner(dls, small_cnn(2).cuda(), loss_func=CrossEntropyLossFlat(), path=tmp_path, opt_func=SGD,
                        cbs=[fs, *([GradientAccumulation(8)] if accumulate else []), seen])
        with quiet(learn): learn.fit(1, 0.1)
        assert isinstance(learn.opt, Optimizer if fastai_opt else FastOptimizer)
        return torch.cat([p.detach().flatten() for p in learn.model.parameters()]),seen.seen
    (eager,_),(graphed,seen) = fit(False),fit(True)
    whole = case == "fastai's optimizer, the step's graph"
    assert seen == [dict(whole=whole, graphs=1, uncaptured=3 if whole else 0, failed=None)], seen
    assert torch.allclose(graphed, eager, rtol=1e-3, atol=1e-5), (graphed - eager).abs().max()


# ---------------------------------------------------------------- graph='auto': capture when it is faster

def test_auto_on_the_cpu_says_nothing_and_a_wrong_graph_is_refused(dls, tmp_path):
    "`FastStep()` (graph='auto') on the CPU: nothing to capture, nothing said; `graph=True` there says why; other values are refused"
    def said(fs):
        learn = learner(make_dls(), tmp_path, fast=False, cbs=[fs])
        with quiet(learn), warnings.catch_warnings(record=True) as w:
            warnings.simplefilter('always'); learn.fit(1, 1e-2)
        return [str(x.message) for x in w if 'FastStep' in str(x.message)]
    assert said(FastStep()) == []
    assert any('not on a CUDA device' in m for m in said(FastStep(graph=True)))
    with pytest.raises(ValueError, match="'auto'"): FastStep(graph='yes')


def test_capture_seconds_add_up_over_the_fits(tmp_path):
    """`FastStep.capture_seconds` (what `start_costs` reads): 0 on the CPU, where nothing is captured; then each fit's
    `GraphCapture.capture_seconds`, counted while the fit runs and kept after it lets its graphs go"""
    from fastai.callback.core import Callback
    fs,seen = FastStep(graph=True),[]
    learn = learner(make_dls(), tmp_path, fast=False, cbs=[fs])
    def fit():
        with quiet(learn), warnings.catch_warnings(): warnings.simplefilter('ignore'); learn.fit(1, 1e-2)
    fit()
    assert fs.capture_seconds == 0
    class Captured(Callback):  # what a capture at the fit's first batch adds to the fit's `GraphCapture` (none runs on the CPU)
        order = FastStep.order + 1
        def before_train(self): fs.capture.capture_seconds += 1.5; seen.append(fs.capture_seconds)
    learn.add_cb(Captured())
    fit(); assert (seen, fs.capture_seconds) == ([1.5], 1.5)
    fit(); assert (seen, fs.capture_seconds) == ([1.5, 3.], 3.)


class _Rigged(StepRace):
    "A race whose clock says what the test wants: `eager` and `graph` seconds for their stretches"
    def __init__(self, eager, graph):
        super().__init__(warmup=1, n=2)
        self.times = iter([0, eager, 100, 100 + graph])
    def _now(self): return next(self.times)


@needs_gpu("FastStep(graph='auto') captures on a CUDA device")
@pytest.mark.parametrize('faster', ['graph', 'eager'])
def test_auto_trains_on_with_the_faster_step(tmp_path, monkeypatch, faster):
    "The race's winner trains the rest of the fit (the graphs kept, or let go), and the weights are those of the uncaptured step"
    import dali_fastai.faststep as faststep
    from fastai.callback.core import Callback
    from fastai.data.core import DataLoaders
    from fastai.data.load import DataLoader
    monkeypatch.setattr(faststep, 'StepRace', lambda: _Rigged(*((2, 1) if faster == 'graph' else (1, 2))))
    monkeypatch.setattr(faststep, 'RACE_FROM', 0)  # a fit of 10 batches races
    kept = {}
    class AtTheEnd(Callback):
        order = FastStep.order + 1
        def after_train(self):
            cap = self.learn.fast_step.capture
            if cap is not None: kept.update(winner=cap.race.winner, graphs=len(cap.graphs), forward='forward' in vars(cap.model))
    g = torch.Generator().manual_seed(0)
    ds = list(zip(torch.randn(48, 3, 16, 16, generator=g), torch.randint(0, 2, (48,), generator=g)))
    def weights(graph):
        dls = DataLoaders(DataLoader(ds[:40], bs=4), DataLoader(ds[40:], bs=4))  # no shuffle: the same batches; 10 a training epoch
        learn = Learner(dls, small_cnn(2).cuda(), loss_func=CrossEntropyLossFlat(), path=tmp_path, cbs=[FastStep(graph=graph), AtTheEnd()])
        with quiet(learn), warnings.catch_warnings(record=True) as w:
            warnings.simplefilter('always'); learn.fit(1, 1e-2)
        assert not [x for x in w if 'FastStep' in str(x.message)], [str(x.message) for x in w]
        return torch.cat([p.detach().flatten() for p in learn.model.parameters()])
    auto = weights('auto')
    assert kept == ({'winner': 'graph', 'graphs': 1, 'forward': True} if faster == 'graph' else {'winner': 'eager', 'graphs': 0, 'forward': False})
    assert torch.allclose(auto, weights(False), rtol=1e-3, atol=1e-5)


def _race(times, verdicts=None, key='k'):
    "A race of one batch each way after none of warm-up, on a clock reading `times`; the stages it went through"
    race = StepRace(warmup=0, n=1, clock=iter(times).__next__, sync=lambda: None)
    if verdicts is not None: race.recall(verdicts, key)
    for _ in range(2): race.before_batch()
    race.captured()
    for _ in range(2): race.before_batch()
    return race


def test_the_race_keeps_the_faster_and_a_tie_the_uncaptured():
    assert _race([0, 2, 2, 3]).winner == 'graph'
    assert _race([0, 2, 2, 5]).winner == 'eager'
    assert _race([0, 2, 2, 4]).winner == 'eager', "a tie keeps the uncaptured step: the capture is not paid for nothing"


def test_a_fit_takes_the_winner_of_an_earlier_race_for_the_same_batches_and_parameters():
    verdicts = {}
    assert _race([0, 2, 2, 3], verdicts).winner == 'graph' and verdicts == {'k': 'graph'}
    again = _race([], verdicts)  # an empty clock: reading it would fail
    assert (again.stage, again.winner, again.wants_graph()) == ('done', 'graph', True)
    assert _race([0, 2, 2, 5], verdicts, key='unfrozen').winner == 'eager' and verdicts == {'k': 'graph', 'unfrozen': 'eager'}


def test_faststep_keeps_each_finished_races_times_by_its_key():
    fast = FastStep()
    race = _race([0, 2, 2, 3], fast.verdicts)
    fast.capture = SimpleNamespace(race=race, release=lambda: None, capture_seconds=0.)
    fast._let_capture_go()
    assert fast.race_seconds == {'k': {'eager': 2, 'graph': 1}} and fast.verdicts == {'k': 'graph'}
    unfinished = StepRace(); unfinished.recall(fast.verdicts, 'other')
    fast.capture = SimpleNamespace(race=unfinished, release=lambda: None, capture_seconds=0.)
    fast._let_capture_go()
    assert 'other' not in fast.race_seconds, "a race the fit did not finish has no times"


def test_lr_find_and_short_fits_capture_without_a_race(dls, tmp_path, monkeypatch):
    "`lr_find` reads every batch's loss, where the captured step always waits less, and a short fit cannot win back a race's cost: FastStep() captures there from the first batch, and leaves no verdict"
    import dali_fastai.faststep as faststep
    learn = learner(dls, tmp_path)
    fast = next(cb for cb in learn.cbs if isinstance(cb, FastStep))
    seen = []
    class Spy(Callback):
        order = FastStep.order + 1
        def before_batch(self):
            if self.training: seen.append((fast.capture.race.stage, fast.capture.race.winner, fast.capture.race.verdicts is fast.verdicts))
    learn.add_cb(Spy())
    with quiet(learn): learn.lr_find(num_it=6, show_plot=False)
    assert seen and set(seen) == {('done', 'graph', False)}, seen
    assert fast.verdicts == {} and fast.race_seconds == {}
    seen.clear()
    with quiet(learn): learn.fit(1, 1e-2)
    assert len(seen) < faststep.RACE_FROM and set(seen) == {('done', 'graph', False)}, "a short fit does not race"
    seen.clear()
    monkeypatch.setattr(faststep, 'RACE_FROM', len(seen) + 2*len(learn.dls.train))
    with quiet(learn): learn.fit(2, 1e-2)
    assert seen[0][:2] == ('warmup', None) and seen[0][2], "a fit of RACE_FROM batches races, for the fits after it"


def test_a_fit_is_short_by_the_batches_a_rank_reads(monkeypatch):
    "Under DDP `FastStep` counts a rank's batches, before `DaliDistributed` has made its loader a shard; a loader with no length counts as long"
    import dali_fastai.faststep as faststep
    class Unsized:
        def __len__(self): raise TypeError("no len: made with n=None")
    assert faststep._rank_batches(list(range(10))) == 10 and faststep._rank_batches(Unsized()) is None
    monkeypatch.setattr(faststep, 'num_distrib', lambda: 4)
    assert faststep._rank_batches(list(range(10))) == 3, "a quarter of the whole set's, rounded up"
    class Shard(list): world_size = 4  # a loader the user sharded: its length is a rank's already
    assert faststep._rank_batches(Shard(range(10))) == 10



@needs_gpu("a CUDA graph's capture")
def test_capture_right_after_the_gpu_libraries_thread_starts(monkeypatch):
    "A capture must not run beside the thread that starts the GPU's libraries (`start_gpu_libraries`): it waits for it"
    import time
    import dali_fastai.epoch as epoch
    epoch.gpu_libraries_started()  # any thread an earlier test started has ended
    slow = lambda device: (time.sleep(2), epoch.first_step(device))  # a start that lasts longer than the capture
    epoch._STARTING.clear()  # as in a fresh process: the thread starts now, and the capture comes at once
    monkeypatch.setattr(epoch, '_quietly', slow)
    epoch.start_gpu_libraries(torch.device('cuda'))
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(8, 2)).cuda()
    warned = []
    cap = GraphCapture(SimpleNamespace(model=model), warned.append, whole=False); cap.install()  # the model's capture, at its first batch
    model(torch.randn(4, 3, 16, 16, device='cuda')).sum().backward()
    assert not warned and cap.graphs, warned
    assert not any(t.is_alive() for t in epoch._STARTING.values()), "the capture waited for the thread to end"


class _FreedLate:
    "Garbage only Python's cyclic collector frees, telling when (as a DALI pipeline let go of earlier, whose destructor syncs the device)"
    def __init__(self, log:list, when:dict): self.me,self.log,self.when = self,log,when
    def __del__(self): self.log.append(self.when['now'])

def test_no_garbage_is_collected_during_a_capture(monkeypatch):
    """What the collector would free mid-capture (a DALI pipeline, whose destructor syncs the device and so breaks the
    capture, seen on one rank of two H200s) waits until the capture has ended: `_capturing` turns the collector off"""
    import gc
    from dali_fastai.capture import _capturing
    monkeypatch.setattr(torch.cuda, 'current_stream', lambda device=None: None)  # the capture's stream, on a machine without CUDA
    log,when = [],{'now': 'during'}
    with _capturing(SimpleNamespace(capture_seconds=0.), torch.device('cpu'), 'the model'):
        _FreedLate(log, when)
        junk = [[] for _ in range(20_000)]  # a forward's allocations: enough to run the collector
        when['now'] = 'after'  # the capture's end: what is freed from here on is freed after it
    gc.collect()
    assert log == ['after'] and gc.isenabled(), log


@needs_gpu("a CUDA graph's capture beside a DALI pipeline on the GPU")
def test_a_dali_pipeline_freed_by_the_collector_does_not_break_a_capture():
    """A DALI pipeline let go of in a reference cycle is freed by the collector, and its destructor syncs the device: had the
    collector run during the inference forward's capture, run by the forward's allocations, the process would stop (DALI's
    CUDAError, "operation not permitted when stream is capturing"; seen with the collector left on)"""
    import gc
    from nvidia.dali import fn, pipeline_def
    @pipeline_def(batch_size=4, num_threads=1, device_id=torch.cuda.current_device())
    def _gpu_pipe(): return fn.random.uniform(shape=[1024]).gpu()*2
    class _Allocates(nn.Module):  # a forward that makes garbage enough to run the collector
        def __init__(self): super().__init__(); self.body = small_cnn(2)
        def forward(self, x): junk = [[] for _ in range(20_000)]; return self.body(x)
    model = _Allocates().cuda().eval()
    warned = []; fc = ForwardCapture(warned.append)
    fc.install(model)
    x,log = torch.randn(8, 3, 16, 16, device='cuda'),[]
    with torch.no_grad():
        for _ in range(3):
            fc._forget(); fc.modes = False  # captured anew, beside new garbage
            eager = model(x)  # the first forward of a shape runs uncaptured
            p = _gpu_pipe(); p.build(); p.run(); torch.cuda.synchronize()
            gc.collect(); _FreedLate(log, {'now': 'freed'}).pipe = p; del p  # the pipeline's only holder, in a cycle
            out = model(x)  # captured: the collector is due during its forward
    gc.collect()
    assert not warned and fc.graphs and fc.replays >= 3, warned
    assert len(log) == 3
    torch.testing.assert_close(out, eager)


def _raised_while_capturing(first:str):
    "A capture's end raising CUDA's 'invalidated' error while handling `first`, the error that broke it"
    try: raise RuntimeError(f"CUDA error: {first}")
    finally: raise RuntimeError("CUDA error: operation failed due to a previous error during capture\nSearch for ...")

@pytest.mark.parametrize('first,told', [('operation failed due to a previous error during capture', 'again'),
                                        # cuDNN and cuBLAS, when one of their launches is the first to meet the broken capture (on an H200)
                                        ('cuDNN error: CUDNN_STATUS_EXECUTION_FAILED_CUDART', 'again'),
                                        ('CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle, opa, opb, m, n, k)`', 'again'),
                                        ('operation not permitted when stream is capturing', 'fail')])
def test_a_capture_another_thread_broke_is_told_apart(monkeypatch, first, told):
    """A capture whose first error is CUDA's 'invalidated' one, or cuDNN's or cuBLAS's before capture's end said 'invalidated',
    was broken by no op of its own (another thread synced the device): `again` is told, to try at the next forward; one that
    an op of the capture broke (a host read) is a failure. Either way the libraries' leftovers are met, and the graph's pool released"""
    from dali_fastai.capture import _capturing
    monkeypatch.setattr(torch.cuda, 'current_stream', lambda device=None: None)  # what CUDA's calls give, without CUDA
    monkeypatch.setattr(torch.cuda, 'set_stream', lambda stream: None)
    monkeypatch.setattr(capture, '_rng_out_of_capture', lambda device: None)
    spent,released,pool = [],[],(0, 7)
    monkeypatch.setattr(capture, '_leftovers_spent', spent.append)
    monkeypatch.setattr(capture, '_pool_released', lambda p, device: released.append(p))
    seen = []
    with _capturing(SimpleNamespace(capture_seconds=0.), torch.device('cpu'), 'the model', fail=lambda why: seen.append(('fail', why)),
                    again=lambda why: seen.append(('again', why)), pool=pool):
        _raised_while_capturing(first)
    assert [k for k,_ in seen] == [told] and seen[0][1].startswith(f'capturing the model failed (RuntimeError: CUDA error: {first}'), seen
    assert spent == [torch.device('cpu')] and released == [pool]


def test_a_library_error_without_a_broken_capture_is_a_failure():
    "cuDNN's error in a capture whose end did not say 'invalidated' (or outside any capture's end) is the model's own: not tried again"
    from dali_fastai.capture import _invalidated
    try:
        try: raise RuntimeError("cuDNN error: CUDNN_STATUS_EXECUTION_FAILED_CUDART")
        finally: raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
    except RuntimeError as e: assert not _invalidated(e)
    assert not _invalidated(RuntimeError("cuDNN error: CUDNN_STATUS_EXECUTION_FAILED_CUDART"))


def _sync_quietly():
    try: torch.cuda.synchronize()
    except RuntimeError: pass  # "operation not permitted when stream is capturing": said to this thread, and the capture is broken

class _SyncedElsewhere(nn.Module):
    "Has another thread sync the device during its first `times` captures (as an unknown thread did beside one on 2 H200s), before its forward or after"
    def __init__(self, times:int, after:bool=False): super().__init__(); self.body,self.times,self.after = small_cnn(2),times,after
    def forward(self, x):
        breaks = self.times and torch.cuda.is_current_stream_capturing()
        if breaks: self.times -= 1
        if breaks and not self.after: _sync_elsewhere()
        out = self.body(x*1)
        if breaks and self.after: _sync_elsewhere()
        return out

def _sync_elsewhere(): t = threading.Thread(target=_sync_quietly); t.start(); t.join()

@needs_gpu("a CUDA graph's capture, broken by another thread's sync")
@pytest.mark.parametrize('breaks', [ForwardCapture.retries, ForwardCapture.retries + 1])
def test_a_capture_another_thread_broke_is_tried_again(breaks):
    """The inference forward's capture broken by another thread's sync of the device is tried again at the next forward of
    that shape, `retries` times, then said once: each forward meanwhile gives what the uncaptured forward gives"""
    model = _SyncedElsewhere(breaks).cuda().eval()
    warned = []; fc = ForwardCapture(warned.append)
    fc.install(model)
    x = torch.randn(8, 3, 16, 16, device='cuda')
    with torch.no_grad(): outs = [model(x) for _ in range(breaks + 3)]  # uncaptured first; then the tries, and replays
    for out in outs[1:]: torch.testing.assert_close(out, outs[0])
    if breaks <= ForwardCapture.retries: assert not warned and fc.graphs and fc.replays == 2, (warned, fc.replays)
    else:
        assert len(warned) == 1 and 'operation failed due to a previous error during capture' in warned[0], warned
        assert not fc.graphs and fc.replays == 0



@needs_gpu("a CUDA graph's capture, broken by another thread's sync, and the memory it kept")
def test_a_broken_capture_gives_its_memory_back(monkeypatch):
    """A capture another thread broke after the forward (its pool full of the forward's memory) gives that pool back: after
    `empty_cache`, two broken captures keep less than half of what they keep with `_pool_released` left out"""
    def kept_by_two_breaks()->int:
        model = _SyncedElsewhere(ForwardCapture.retries, after=True).cuda().eval()
        fc = ForwardCapture(lambda m: None); fc.install(model)
        x = torch.randn(64, 3, 64, 64, device='cuda')
        with torch.no_grad():
            model(x)  # the first forward of a shape runs uncaptured
            torch.cuda.synchronize(); torch.cuda.empty_cache(); before = torch.cuda.memory_reserved()
            for _ in range(ForwardCapture.retries): model(x)  # broken captures, tried again
        assert fc.broken == ForwardCapture.retries and not fc.graphs
        torch.cuda.synchronize(); torch.cuda.empty_cache()
        return torch.cuda.memory_reserved() - before
    released = kept_by_two_breaks()
    with monkeypatch.context() as m:
        m.setattr(capture, '_pool_released', lambda pool, device: None)
        kept = kept_by_two_breaks()
    assert kept > 0 and released < kept/2, (released, kept)


# ---------------------------------------------------------------- the inference forward, captured (`ForwardCapture`)

def test_faststep_pickles_without_its_inference_graphs(tmp_path):
    "`export` pickles the callbacks: `FastStep`'s `ForwardCapture` goes without the model it was of (a weak reference) and its graphs"
    import pickle
    fs = FastStep(graph=True)
    model = small_cnn(2)
    fs.forwards._forget(model)  # as `install` leaves it on a GPU
    back = pickle.loads(pickle.dumps(fs))
    assert back.forwards.of is None and back.forwards.graphs == {} and back.graph is True
    assert FastStep(graph=False).forwards is None


def _tensor_dls(n_train=24, n_valid=20, bs=8):
    from fastai.data.core import DataLoaders
    from fastai.data.load import DataLoader
    g = torch.Generator().manual_seed(0)
    ds = list(zip(torch.randn(n_train + n_valid, 3, 16, 16, generator=g), torch.randint(0, 2, (n_train + n_valid,), generator=g)))
    return DataLoaders(DataLoader(ds[:n_train], bs=bs, shuffle=True), DataLoader(ds[n_train:], bs=bs))


def _eager_validate(learn, fs)->list:
    "What validation gives with the model's own forward"
    forwards,fs.forwards = fs.forwards,None
    try: return [float(v) for v in learn.validate()]
    finally: fs.forwards = forwards


@needs_gpu("FastStep captures the inference forward on a CUDA device")
def test_validation_replays_the_captured_forward_with_the_trained_weights(tmp_path):
    """Each fit's validations replay graphs of the inference forward (one a batch shape: 8 and the last 4), captured once and
    kept across fits: the values are those of the uncaptured forward with the weights as trained so far"""
    fs = FastStep(graph=True)
    learn = Learner(_tensor_dls(), small_cnn(2).cuda(), loss_func=CrossEntropyLossFlat(), metrics=accuracy, path=tmp_path, cbs=fs)
    with quiet(learn), warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always'); learn.fit(3, 1e-2)
    assert not [x for x in w if 'FastStep' in str(x.message)], [str(x.message) for x in w]
    assert len(fs.forwards.graphs) == 2 and fs.forwards.replays > 0 and fs.forwards.capture_seconds > 0
    graphs = {k: g for k,(g,_,_) in fs.forwards.graphs.items()}
    for _ in range(2):
        replays = fs.forwards.replays
        with quiet(learn): learn.fit(1, 1e-2)
        recorded = [float(v) for v in learn.recorder.values[-1][1:]]  # the fit's validation: loss, accuracy
        got = [float(v) for v in learn.validate()]
        assert fs.forwards.replays > replays and {k: g for k,(g,_,_) in fs.forwards.graphs.items()} == graphs, "the same graphs, replayed"
        assert got == pytest.approx(_eager_validate(learn, fs), rel=1e-5, abs=1e-6)
        assert got == pytest.approx(recorded, rel=1e-5, abs=1e-6)


@needs_gpu("FastStep captures the inference forward on a CUDA device")
def test_moved_parameters_or_another_model_are_captured_anew(tmp_path):
    "Graphs read the parameters where they were: a model whose parameters moved, or another model, gets new graphs"
    fs = FastStep(graph=True)
    learn = Learner(_tensor_dls(), small_cnn(2).cuda(), loss_func=CrossEntropyLossFlat(), metrics=accuracy, path=tmp_path, cbs=fs)
    with quiet(learn): learn.fit(1, 1e-2); learn.validate()
    old = dict(fs.forwards.graphs)
    with torch.no_grad():
        for t in learn.model.parameters(): t.data = t.data.clone().mul_(1.1)  # as `model.to(...)` moves them, new values too: a stale graph would show
    with quiet(learn): learn.validate(); got = [float(v) for v in learn.validate()]  # the first forward of a shape runs uncaptured
    new = fs.forwards.graphs
    assert new.keys() == old.keys() and all(new[k][0] is not old[k][0] for k in new), "captured anew"
    assert got == pytest.approx(_eager_validate(learn, fs), rel=1e-5, abs=1e-6)
    learn.model = small_cnn(2).cuda()
    with quiet(learn): learn.validate(); got = [float(v) for v in learn.validate()]
    assert fs.forwards.of() is learn.model and got == pytest.approx(_eager_validate(learn, fs), rel=1e-5, abs=1e-6)


@needs_gpu("FastStep captures the inference forward on a CUDA device")
def test_get_preds_gives_what_the_uncaptured_forward_gives(tmp_path):
    "`get_preds` replays the graphs, with the uncaptured forward's values and types; a host read in the forward is said once and runs uncaptured"
    fs = FastStep(graph=True)
    learn = Learner(_tensor_dls(), small_cnn(2).cuda(), loss_func=CrossEntropyLossFlat(), path=tmp_path, cbs=fs)
    with quiet(learn): learn.fit(1, 1e-2)
    preds,targs = learn.get_preds()
    forwards,fs.forwards = fs.forwards,None
    want,_ = learn.get_preds()
    fs.forwards = forwards
    assert forwards.replays > 0 and type(preds) is type(want) and torch.allclose(preds, want, rtol=1e-5, atol=1e-6)
    learn.model = nn.Sequential(small_cnn(2), _HostRead()).cuda()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        for _ in range(3): learn.get_preds()
    said = [str(x.message) for x in w if 'inference forward' in str(x.message)]
    assert len(said) == 1 and 'failed' in said[0], said
    assert torch.nn.functional.dropout(torch.ones(8, device='cuda'), 0.5).isfinite().all()


@needs_gpu("FastStep captures the inference forward on a CUDA device")
def test_a_hooked_forward_runs_uncaptured(tmp_path):
    "A forward hook on any module (`learn.summary`'s, `hook_output`'s) sees every forward: with one set, the graphs are not replayed"
    fs = FastStep(graph=True)
    learn = Learner(_tensor_dls(), small_cnn(2).cuda(), loss_func=CrossEntropyLossFlat(), path=tmp_path, cbs=fs)
    with quiet(learn): learn.fit(1, 1e-2); learn.get_preds(); learn.get_preds()
    replays,seen = fs.forwards.replays,[]
    assert replays > 0
    h = learn.model[3].register_forward_hook(lambda m, i, o: seen.append(o.shape[0]))
    learn.get_preds(); learn.get_preds()
    h.remove()
    assert seen == [8, 8, 4]*2 and fs.forwards.replays == replays, (seen, fs.forwards.replays, replays)
    learn.get_preds()
    assert fs.forwards.replays > replays, "replayed again once the hook is gone"
