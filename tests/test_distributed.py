"""DDP sharding (simulated ranks, and a real two-process run on the CPU through fastai's `distrib_ctx`), and resuming
mid-epoch from a checkpoint."""
import json, os, random, socket, subprocess, sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from fastcore.basics import first
from torch import nn
from fastai.callback.core import Callback, CancelFitException
from fastai.callback.schedule import fit_one_cycle  # noqa: F401 (adds Learner.fit_one_cycle)
from fastai.callback.tracker import SaveModelCallback
from fastai.distributed import DistributedDL
from fastai.learner import Learner
from fastai.losses import CrossEntropyLossFlat
from fastai.vision.augment import Resize, aug_transforms

from helpers import flat, index_items, index_loader, epoch_items, MAX_INDEX
import ddp_worker
from dali_fastai.loader import DaliDataLoader, ImageItems, batches_per_rank
from dali_fastai.data import DaliDataLoaders
from dali_fastai.distributed import DaliCheckpoint, DaliDistributed, DaliShard, STATE_KEY

HERE = Path(__file__).parent


# ---------------------------------------------------------------- simulated ranks: shards, counts, exactly once

GRID = [(n, bs, w) for w in (2, 3, 4) for bs in (1, 2, 7) for n in sorted({w, w*bs - 1, w*bs, w*bs + 1, 2*w*bs + 1, 31})
        if n >= w]


@pytest.mark.parametrize('n,bs,world', GRID, ids=[f'n{n}-bs{bs}-w{w}' for n,bs,w in GRID])
def test_valid_shards_cover_every_item_once_in_order(files, n, bs, world):
    ranks = [index_loader(files[:n], bs, seed=0).shard(r, world) for r in range(world)]
    got = [epoch_items(dl) for dl in ranks]
    assert [len(b) for b in got] == [len(ranks[0])]*world == [batches_per_rank(n, bs, world, pad=True)]*world
    gathered = [i for k in range(len(ranks[0])) for b in got for i in b[k]]
    assert gathered == list(range(n)), "batch k of rank 0, 1, ... is the items in order, each once"


@pytest.mark.parametrize('drop_last', [True, False])
@pytest.mark.parametrize('n,bs,world', GRID, ids=[f'n{n}-bs{bs}-w{w}' for n,bs,w in GRID])
def test_train_shards_in_step_and_disjoint(files, n, bs, world, drop_last):
    ranks = [index_loader(files[:n], bs, train=True, drop_last=drop_last, seed=3, warp_mode=None).shard(r, world)
             for r in range(world)]
    want = batches_per_rank(n, bs, world, drop_last)
    epochs = []
    for _ in range(3):
        got = [epoch_items(dl) for dl in ranks]
        assert [len(b) for b in got] == [want]*world, "every rank takes the same number of steps"
        if drop_last: assert all(len(b) == bs for r in got for b in r)
        seen = flat(flat(got))
        assert len(seen) == len(set(seen)), "no item twice in an epoch, on any rank"
        assert len(seen) >= n - world*bs, "at most a batch a rank left for a later epoch"
        epochs.append([flat(r) for r in got])
    if n > bs*world: assert epochs[0] != epochs[1] != epochs[2], "every epoch a new order"


def gradient_items(tmp_path, n:int)->ImageItems:
    "`n` copies of one gradient image (crops, flips and warps change its pixels), labelled 0"
    f = tmp_path/'gradient.png'
    if not f.exists():
        x = np.arange(16, dtype=np.uint8)*15
        Image.fromarray(np.stack([x[None, :].repeat(16, 0), x[:, None].repeat(16, 1), np.full((16, 16), 90, np.uint8)], -1)).save(f)
    return ImageItems([f]*n, [0]*n, ['a'])


def test_ranks_draw_their_own_augmentation(tmp_path):
    "The same image on both ranks: rank seeds differ, so the augmented batches differ; the shared order seed does not"
    dls = [DaliDataLoader(gradient_items(tmp_path, 16), bs=4, size=8, train=True, device='cpu', seed=5).shard(r, 2) for r in range(2)]
    (x0,_),(x1,_) = [first(dl) for dl in dls]
    assert not torch.equal(x0, x1)
    assert dls[0]._source.order_seed == dls[1]._source.order_seed


def test_train_style_loader_in_order_pads_like_validation(files):
    "`get_preds(ds_idx=0)` reads the training set in order, keeping the last batch: every item once across ranks"
    ranks = [index_loader(files[:9], 2, train=True, shuffle=False, drop_last=False, seed=0, warp_mode=None).shard(r, 2)
             for r in range(2)]
    got = [epoch_items(dl) for dl in ranks]
    assert [len(b) for b in got] == [3, 3]
    assert [i for k in range(3) for b in got for i in b[k]] == list(range(9))


def test_shard_errors(files):
    with pytest.raises(ValueError, match='every rank must draw the same order'): index_loader(files[:8], 2).shard(0, 2)
    with pytest.raises(ValueError, match='rank must be in 0..1'): index_loader(files[:8], 2, seed=0).shard(2, 2)
    with pytest.raises(ValueError, match='3 items cannot be split between 4 ranks'): index_loader(files[:3], 2, seed=0).shard(0, 4)


def test_shared_seed_regenerates_the_fixed_warps(files):
    "A loader made without a seed takes the seed rank 0 sent, and its fixed warps with it: the same on every rank"
    a,b = [index_loader(files[:20], 4, train=True) for _ in range(2)]
    assert not (a.aug['warps'] == b.aug['warps']).all()
    a.shard(0, 2, seed=11); b.shard(1, 2, seed=11)
    assert (a.aug['warps'] == b.aug['warps']).all() and a.seed == b.seed == 11


def test_unshard_restores_the_whole_set(files):
    dl = index_loader(files[:9], 2, seed=0).shard(0, 2)
    assert epoch_items(dl) == [[0, 1], [4, 5], []], "shards of 4 and 5: rank 0 gets an empty third batch"
    dl.shard(0, 1)
    assert flat(epoch_items(dl)) == list(range(9))


def test_a_shard_keeps_no_decoder_beside_its_pipelines(files, monkeypatch):
    "One GPU: a decoder kept for the process (`keep_decoder`); a shard of several (DDP), whose ranks start decoders at once: none"
    import dali_fastai.loader as loader
    kept,loads = [],[]
    monkeypatch.setattr(loader, 'keep_decoder', lambda device_id, load: kept.append(load))
    dl = index_loader(files[:8], 2, seed=0, hw_decoder_load=0.5, decode_on='gpu')  # ('auto' keeps one once it moves)
    build = dl.recipe.build
    monkeypatch.setattr(dl.recipe, 'build', lambda *a, **kw: loads.append(kw['hw_decoder_load']) or build(*a, **kw))
    epoch_items(dl)
    assert kept == [0.5], "alone: one decoder kept, with the loader's share for the hardware decoder"
    epoch_items(dl.shard(1, 2))
    assert kept == [0.5], "a shard: no decoder kept"
    assert loads == [0.5, 0.5], "the share the user gave reaches every pipeline's decoder, shard or not"
    epoch_items(dl.shard(0, 1))
    assert kept == [0.5, 0.5], "unsharded again: kept (once a process: `keep_decoder` itself skips a GPU it holds one for)"


def test_dali_shard_is_a_distributed_dl_fastai_leaves_alone(files):
    dl = index_loader(files[:10], 4, seed=0)
    s = DaliShard(dl.shard(0, 2))
    assert isinstance(s, DistributedDL), "fastai's DistributedTrainer._wrap_dl returns DistributedDLs unchanged"
    assert len(s) == len(dl) and s.vocab is dl.vocab and s.bs == 4 and s.device == dl.device
    assert isinstance(s.new(shuffle=True), DaliDataLoader)
    assert [y.tolist() for _,y in s] == [[0, 1, 2, 3], [8]]  # rank 1 has [4 5 6 7] [9]
    x = torch.arange(6.)
    assert torch.equal(s.to_detach(x), x), "no second gather: DaliDistributed gathered the batch already"


def test_callback_does_nothing_on_one_process(files, tmp_path):
    dls = DaliDataLoaders(index_loader(files[:16], 4, train=True, seed=0, warp_mode=None), index_loader(files[16:24], 4),
                          path=tmp_path, device='cpu')
    learn = Learner(dls, nn.Sequential(nn.Flatten(), nn.Linear(192, MAX_INDEX)), loss_func=CrossEntropyLossFlat(),
                    cbs=DaliDistributed())
    with learn.no_bar(), learn.no_logging(): learn.fit(1)
    assert all(type(dl) is DaliDataLoader and dl.world_size == 1 for dl in learn.dls.loaders)


# ---------------------------------------------------------------- a real two-process run (gloo on the CPU)

def test_two_processes_through_distrib_ctx(tmp_path):
    "torchrun, `learn.distrib_ctx()`, DaliDistributed: shards in step, valid once across ranks, whole-set metrics"
    try: import accelerate  # noqa: F401 (fastai's distrib_ctx needs it)
    except ImportError: pytest.fail("accelerate is not installed: it is a dev dependency (pip install -e '.[dev]'), "
                                    "and without it the only real two-process test would not run")
    with socket.socket() as s: s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', '2', '--master_port', str(port),
           str(HERE/'ddp_worker.py'), str(tmp_path)]
    env = {**os.environ, 'OMP_NUM_THREADS': '1'}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    ddp_worker.check(tmp_path)


def test_two_nodes_of_two_processes(tmp_path):
    "Multi-node DDP as torchrun runs it, two 'nodes' on this host (gloo on the CPU): every item once per epoch across 4 ranks, validation metrics of the whole set"
    pytest.importorskip('accelerate', reason="fastai's distrib_ctx needs accelerate (a dev dependency)")
    with socket.socket() as s: s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]
    env = {**os.environ, 'OMP_NUM_THREADS': '1'}
    nodes = [subprocess.Popen([sys.executable, '-m', 'torch.distributed.run', '--nnodes', '2', '--node_rank', str(k),
                               '--nproc_per_node', '2', '--master_addr', '127.0.0.1', '--master_port', str(port),
                               str(HERE/'ddp_worker.py'), str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for k in range(2)]
    try: outs = [n.communicate(timeout=300) for n in nodes]
    finally:
        for n in nodes: n.kill()
    assert all(n.returncode == 0 for n in nodes), '\n'.join(err[-2000:] for _,err in outs)
    ddp_worker.check(tmp_path, world=4)


def docs_train_script(folder:Path)->str:
    "The distributed notebook's `train.py`, as written, with its folder, batch size, image size, model and epochs swapped for small ones"
    cells = json.loads((HERE.parent/'nbs'/'07a_distributed.ipynb').read_text())['cells']
    text = next(''.join(c['source']) for c in cells if c['cell_type'] == 'markdown' and 'where `train.py` is' in ''.join(c['source']))
    script = text.split('where `train.py` is an ordinary fastai script:\n```python\n')[1].split('```')[0]
    # small data, no download of pretrained weights (no network here): each swap must find its text, or the docs changed
    for old,new in [("'/data/imagenette'", repr(str(folder))), ('bs=256', 'bs=4'), ('size=224', 'size=16'),
                    ('resnet50,', 'resnet18, pretrained=False,'), ('fit_one_cycle(5,', 'fit_one_cycle(1,')]:
        assert script.count(old) == 1, f"the docs' train.py no longer has {old!r}: update this test's swaps"
        script = script.replace(old, new)
    return script


def test_docs_train_script(tmp_path):
    "The docs' train.py, run as the docs say (`torchrun --nproc_per_node 2 train.py`), on the CPU: it trains and ends well"
    pytest.importorskip('accelerate', reason="fastai's distrib_ctx needs accelerate (a dev dependency)")
    for split,n in (('train', 8), ('valid', 4)):
        for c,colour in (('dark', 40), ('light', 200)):
            (tmp_path/'data'/split/c).mkdir(parents=True)
            for i in range(n): Image.fromarray(np.full((12, 12, 3), colour + i, np.uint8)).save(tmp_path/'data'/split/c/f'{i}.png')
    (tmp_path/'train.py').write_text(docs_train_script(tmp_path/'data'))
    with socket.socket() as s: s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]
    # the package these tests import first (this checkout's, or the copy `tools/mutants.py` plants a bug in)
    path = os.pathsep.join([str(Path(sys.modules['dali_fastai'].__file__).parents[1]),
                            *filter(None, [os.environ.get('PYTHONPATH')])])
    env = {**os.environ, 'OMP_NUM_THREADS': '1', 'PYTHONPATH': path, 'TORCH_HOME': str(tmp_path/'torch')}
    r = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', '2', '--master_port', str(port),
                        str(tmp_path/'train.py')], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert 'has no attribute' not in r.stderr


# ---------------------------------------------------------------- resuming

class Stop(Callback):
    "Record training batches; save with learn.save and stop after batch `stop` (0-based count) of epoch `epoch`"
    def __init__(self, epoch=None, stop=None): self.items,self.epoch_at,self.stop = [],epoch,stop
    def after_batch(self):
        if not self.training: return
        self.items.append(self.yb[0].tolist())
        if self.epoch == self.epoch_at and self.iter == self.stop - 1:
            self.learn.save('ckpt'); raise CancelFitException


def _learner(files, path, *cbs, n=30, seed=1, bs=4):
    dls = DaliDataLoaders(index_loader(files[:n], bs, train=True, seed=seed),
                          index_loader(files[n:n+8], bs), path=path, device='cpu')
    torch.manual_seed(0)
    return Learner(dls, nn.Sequential(nn.Flatten(), nn.Linear(192, MAX_INDEX)), loss_func=CrossEntropyLossFlat(),
                   cbs=[DaliCheckpoint(), *cbs])


@pytest.mark.parametrize('epoch,stop', [(0, 1), (1, 3), (1, 7), (2, 6)], ids=['e0b1', 'e1b3', 'e1-end', 'e2b6'])
def test_resumed_run_sees_the_same_items_and_ends_with_the_same_weights(files, tmp_path, epoch, stop):
    whole = Stop(); a = _learner(files, tmp_path, whole)
    with a.no_bar(), a.no_logging(): a.fit_one_cycle(3, 1e-2)
    first = Stop(epoch, stop); b = _learner(files, tmp_path, first)
    with b.no_bar(), b.no_logging(): b.fit_one_cycle(3, 1e-2)
    rest = Stop(); c = _learner(files, tmp_path, rest)
    c.load('ckpt')
    with c.no_bar(), c.no_logging(): c.fit_one_cycle(3, 1e-2)
    done = 7*epoch + stop
    assert first.items == whole.items[:done]
    assert rest.items == whole.items[done:], "the resumed run trains on exactly the remaining batches, in order"
    for p,q in zip(a.model.parameters(), c.model.parameters()): assert torch.equal(p, q), "same schedule, same updates"



def test_resumed_recorder_matches_fastais_own_resume(files, tmp_path):
    """A run resumed after its first epoch records what fastai's own resume (`fit(..., start_epoch=1)`, its
    `SkipToEpoch`) records: an empty row for the skipped epoch, then one row an epoch, at the same iteration counts"""
    class SaveAfterFirstEpoch(Callback):
        def after_epoch(self): self.learn.save('ckpt'); raise CancelFitException
    first = _learner(files, tmp_path, SaveAfterFirstEpoch())
    with first.no_bar(), first.no_logging(): first.fit_one_cycle(3, 1e-2)
    ours = _learner(files, tmp_path); ours.load('ckpt')
    with ours.no_bar(), ours.no_logging(): ours.fit_one_cycle(3, 1e-2)
    theirs = _learner(files, tmp_path)
    with theirs.no_bar(), theirs.no_logging(): theirs.fit_one_cycle(3, 1e-2, start_epoch=1)
    shape = lambda rec: ([len(v) for v in rec.values], rec.iters)
    assert shape(ours.recorder) == shape(theirs.recorder) == ([0, 2, 2], [0, 7, 14]), (ours.recorder.values, theirs.recorder.values)

AUGMENTATIONS = {'keywords': dict(size=8, p_rotate=0.5, p_vflip=0.5),
                 # fastai's own draws, made on the host and fed by an external_source: DALI's checkpoint restores its iteration
                 'fastai tfms': dict(item_tfms=Resize(8), batch_tfms=aug_transforms(p_lighting=0.5, max_warp=0.3))}

@pytest.mark.parametrize('aug', list(AUGMENTATIONS))
def test_loader_resume_replays_the_same_augmented_pixels(tmp_path, aug):
    "A loader restored from `state_dict` mid-epoch yields the very batches (pixels, not only items) the original would"
    def make(): return DaliDataLoader(gradient_items(tmp_path, 24), bs=4, train=True, device='cpu', seed=2,
                                      **AUGMENTATIONS[aug])
    a = make(); whole = [x for _ in range(2) for x,_ in a]
    b = make(); it = iter(b)
    for _ in range(2): next(it)
    state = json.loads(json.dumps(b.state_dict()))  # it travels as JSON
    c = make(); c.load_state_dict(state)
    rest = [x for x,_ in c] + [x for x,_ in c]
    assert len(rest) == len(whole) - 2
    assert all(torch.equal(p, q) for p,q in zip(rest, whole[2:]))


def test_fastai_draws_leave_the_users_random_streams_alone(tmp_path):
    "fastai's draws use fastai's generators, seeded per batch and put back: the training loop's own draws go on unchanged"
    dl = DaliDataLoader(gradient_items(tmp_path, 24), bs=4, train=True, device='cpu', seed=2, **AUGMENTATIONS['fastai tfms'])
    torch.manual_seed(0); random.seed(0)
    expected = torch.rand(3),random.random()
    torch.manual_seed(0); random.seed(0)
    for _ in range(2):
        for _ in dl: pass
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]


def test_rank_restores_rank_0s_state_into_its_own_shard(files):
    "Under DDP only rank 0 saves; rank 1 restoring rank 0's state resumes rank 1's own items, in the same order"
    def make(r): return index_loader(files[:21], 2, train=True, seed=0, warp_mode=None).shard(r, 2)
    a = make(1); whole = epoch_items(a) + epoch_items(a)
    r0,r1 = make(0),make(1)
    i0,i1 = iter(r0),iter(r1)
    for _ in range(3): next(i0); next(i1)
    resumed = make(1); resumed.load_state_dict(r0.state_dict())
    assert epoch_items(resumed) + epoch_items(resumed) == whole[3:]


def test_save_model_callback_checkpoints_resume(files, tmp_path):
    "SaveModelCallback(every_epoch) saves the loaders too: resuming from epoch 1's file trains epoch 2 only"
    whole = Stop(); a = _learner(files, tmp_path, whole, SaveModelCallback(every_epoch=True, fname='m'))
    with a.no_bar(), a.no_logging(): a.fit(3, 1e-2)
    rest = Stop(); c = _learner(files, tmp_path, rest)
    c.load('m_1')
    with c.no_bar(), c.no_logging(): c.fit(3, 1e-2)
    assert rest.items == whole.items[14:]


def test_load_at_the_end_of_a_fit_moves_nothing(files, tmp_path):
    "SaveModelCallback loads the best model in after_fit: the next fit still trains all its epochs"
    class LoadBest(Callback):  # what SaveModelCallback does, with the first epoch as the best
        order = SaveModelCallback.order
        def after_epoch(self):
            if self.epoch == 0: self.learn.save('best')
        def after_fit(self): self.learn.load('best')
    rec = Stop(); learn = _learner(files, tmp_path, rec, LoadBest())
    with learn.no_bar(), learn.no_logging(): learn.fit(2, 1e-2)
    with learn.no_bar(), learn.no_logging(): learn.fit(2, 1e-2)
    assert len(rec.items) == 4*7


def test_checkpoint_holds_the_state_under_one_key(files, tmp_path):
    learn = _learner(files, tmp_path)
    f = learn.save('x', with_opt=False)
    state = torch.load(f, weights_only=True)
    assert STATE_KEY in state and state[STATE_KEY].dtype == torch.uint8
    plain = nn.Sequential(nn.Flatten(), nn.Linear(192, MAX_INDEX))
    with pytest.raises(RuntimeError, match='dali_fastai.loaders'): plain.load_state_dict(state)
    plain.load_state_dict(state, strict=False)


def test_resume_errors(files, tmp_path):
    first = Stop(1, 2); b = _learner(files, tmp_path, first)
    with b.no_bar(), b.no_logging(): b.fit(3, 1e-2)
    other = _learner(files, tmp_path, n=26)
    other.load('ckpt')
    with pytest.raises(ValueError, match='different loader .*n_items 30 there, 26 here'): other.fit(3)
    same = _learner(files, tmp_path)
    same.load('ckpt')
    with pytest.raises(ValueError, match='fit of 3 epochs, this fit has 2'): same.fit(2)
    with pytest.raises(ValueError, match='not a DaliDataLoader state'): same.dls.train.load_state_dict({'epoch': 1})
