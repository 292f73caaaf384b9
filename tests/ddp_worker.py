"""One rank of a DDP run through fastai's `learn.distrib_ctx()` with `DaliDistributed`; writes what it saw as JSON.

Run by tests/test_distributed.py on the CPU (gloo):  python -m torch.distributed.run --nproc_per_node 2 tests/ddp_worker.py OUT
(and as two "nodes" of two processes: --nnodes 2 --node_rank 0|1 --master_addr 127.0.0.1, then --check OUT 4)
On GPUs:  torchrun --nproc_per_node 2 tests/ddp_worker.py OUT --device gpu && python tests/ddp_worker.py --check OUT
`--fast-step` trains with `FastStep()` (on GPUs it races the captured step against the uncaptured one and keeps the
faster, every rank alike): the same checks hold (the metrics gathered across ranks on the device); `--eager` with
`FastStep(graph=False)`; `--graph` with `FastStep(graph=True)` (captured on a GPU; on the CPU it says why not, once, and
trains uncaptured). Every rank
writes the sum of its weights after the fit: equal on every rank only if DDP averaged every step's gradients.
On GPUs with the graph:  torchrun --nproc_per_node 2 tests/ddp_worker.py OUT --device gpu --graph && python tests/ddp_worker.py --check OUT
On 4 GPUs, batches enough for FastStep()'s race:  torchrun --nproc_per_node 4 tests/ddp_worker.py OUT --device gpu --fast-step --race-from 0
--n-train 231 --bs 2 && python tests/ddp_worker.py --check OUT 4 231 2   (the images are indexed 0..255: n-train + n-valid <= 256)
With FastStep's optimizer DDP is built with gradient_as_bucket_view=True (`BucketViews`); `--no-bucket-view`: FastStep(bucket_view=False), DDP's default."""
import argparse, faulthandler, json, math, os, sys, time
from pathlib import Path

import torch
from torch import nn
from fastai.callback.core import Callback
from fastai.distributed import *  # noqa: F401,F403 (adds Learner.distrib_ctx)
from fastai.learner import Learner
from fastai.losses import CrossEntropyLossFlat
from fastai.metrics import accuracy

sys.path.insert(0, str(Path(__file__).parent))
from helpers import make_index_images, index_items, MAX_INDEX
from dali_fastai.loader import DaliDataLoader
from dali_fastai.data import DaliDataLoaders
from dali_fastai.distributed import DaliDistributed
import dali_fastai.faststep as faststep
from dali_fastai.faststep import FastStep


class Record(Callback):
    "The items of every batch, by phase and epoch"
    order = 100
    def before_fit(self): self.seen,self.graphs,self.forward_sync,self.valid_buffers,self.forwards = {'train': [], 'valid': []},None,[],[],[]
    def before_validate(self):  # the buffers (BatchNorm's statistics) each rank validates with
        self.valid_buffers.append(sum(b.detach().double().sum().item() for b in self.learn.model.buffers()))
    def before_epoch(self): self.seen['train'].append([]); self.seen['valid'].append([])
    def after_batch(self): self.seen['train' if self.training else 'valid'][-1] += self.yb[0].tolist()
    def after_train(self):
        "What `FastStep(graph=True)` captured (read before its `after_fit` lets the graphs go)"
        fs = getattr(self.learn, 'fast_step', None)  # fastai names each callback on its learner
        cap = fs and fs.capture
        self.graphs = None if cap is None else dict(n=len(cap.graphs), failed=cap.failed, race=cap.race and cap.race.winner, whole=cap.whole)
        self.forward_sync.append(getattr(self.learn.model, 'broadcast_buffers', None))  # DDP's broadcast of the buffers at each forward
        self.bucket_views = getattr(self.learn.model, 'gradient_as_bucket_view', None)
    def after_validate(self):
        "The inference forwards `FastStep(graph=True)` replayed so far, and the model they went through (DDP's wrapping, in a fit)"
        fs = getattr(self.learn, 'fast_step', None)
        if fs and fs.forwards: self.forwards.append(dict(replays=fs.forwards.replays, failed=fs.forwards.failed, model=type(self.learn.model).__name__))


def main():
    p = argparse.ArgumentParser()
    p.add_argument('out'); p.add_argument('--device', default='cpu'); p.add_argument('--n-train', type=int, default=61)
    p.add_argument('--n-valid', type=int, default=23); p.add_argument('--bs', type=int, default=4)
    p.add_argument('--fast-step', action='store_true', help="train with FastStep() (fused optimizer, metrics on the device, "
                   "captured where the race finds it faster)")
    p.add_argument('--eager', action='store_true', help="train with FastStep(graph=False): never captured")
    p.add_argument('--graph', action='store_true', help="train with FastStep(graph=True): forward and backward as CUDA graphs")
    p.add_argument('--race-from', type=int, default=None, help="FastStep(): race in fits of this many training batches or more (default: RACE_FROM)")
    p.add_argument('--bn', action='store_true', help="a BatchNorm layer in the model (buffers that DDP keeps in step)")
    p.add_argument('--no-sync-bn', action='store_true', help="on the GPU: distrib_ctx(sync_bn=False), each rank's BatchNorm on its own batch (fastai converts to SyncBatchNorm by default)")
    p.add_argument('--no-bucket-view', action='store_true', help="FastStep(bucket_view=False): DDP built with its default, "
                   "each gradient copied back from DDP's bucket (FastStep asks for the views otherwise)")
    p.add_argument('--seed', type=int, default=None, help="the training loader's seed (default: rank 0 draws one)")
    a = p.parse_args()
    if a.race_from is not None: faststep.RACE_FROM = a.race_from
    faulthandler.enable()  # a crash in C++ (gloo, DALI) prints every thread's Python stack to the test's stderr
    rank, world = int(os.environ['RANK']), int(os.environ['WORLD_SIZE'])
    out = Path(a.out)
    files = make_index_images(out/'images', a.n_train + a.n_valid) if rank == 0 else None
    if rank != 0:
        while not (out/'images'/f'{a.n_train + a.n_valid - 1:03d}.png').exists(): time.sleep(0.05)
        time.sleep(0.2)
        files = sorted((out/'images').glob('*.png'))
    train,valid = index_items(files[:a.n_train]),index_items(files[a.n_train:])
    train_dl = DaliDataLoader(train, bs=a.bs, size=8, train=True, device=a.device, warp_mode=None, seed=a.seed)
    dls = DaliDataLoaders(train_dl, DaliDataLoader(valid, bs=a.bs, size=8, device=a.device), path=out, device=train_dl.device)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), *([nn.BatchNorm1d(3*8*8)] if a.bn else []), nn.Linear(3*8*8, MAX_INDEX))
    rec = Record()
    fast = ([FastStep(graph=True if a.graph else False if a.eager else 'auto', bucket_view=not a.no_bucket_view)]
            if a.fast_step or a.graph or a.eager else [])
    learn = Learner(dls, model, loss_func=CrossEntropyLossFlat(), metrics=accuracy, cbs=[DaliDistributed(), rec, *fast])
    kw = dict(sync_bn=False, cpu=True) if a.device == 'cpu' else dict(sync_bn=False) if a.no_sync_bn else {}
    with learn.distrib_ctx(**kw):
        with learn.no_bar(): learn.fit(2, 1e-2)
        graphs,forward_sync,valid_buffers,forwards,views = rec.graphs,rec.forward_sync,rec.valid_buffers,rec.forwards,rec.bucket_views  # `get_preds` starts the callbacks' `before_fit` again
        seen,ddp_valid = rec.seen,learn.recorder.values[-1][1:]
        lens = [len(learn.dls.train), len(learn.dls.valid)]
        with learn.no_bar(): preds,targs = learn.get_preds()
        restored = [torch.as_tensor(m.value).numel() for m in (learn.recorder.loss, *learn.metrics)]  # kept after the fit
    after_ctx = sum(len(y) for _,y in learn.dls.valid)  # still this rank's shard (documented)
    learn.dls.valid.shard(0, 1)
    after_unshard = sum(len(y) for _,y in learn.dls.valid)
    fs = getattr(learn, 'fast_step', None)
    replaying = fs and fs.forwards
    if fs: fs.forwards = None  # the model's own forward: what the fit's replayed validations are checked against
    whole = learn.validate()  # outside the context: one process, the whole validation set
    if fs: fs.forwards = replaying
    weights = sum(p.detach().double().sum().item() for p in learn.model.parameters())
    buffers = sum(b.detach().double().sum().item() for b in learn.model.buffers())
    res = dict(rank=rank, world=world, graphs=graphs, forwards=forwards, bucket_views=views, weights=weights, buffers=buffers, forward_sync=forward_sync, valid_buffers=valid_buffers, lens=lens, opt=type(learn.opt).__name__, seen=seen, targs=targs.tolist(), n_preds=len(preds),
               ddp_valid=[float(v) for v in ddp_valid], whole_valid=[float(v) for v in whole],
               restored=restored, seed=dls.train.seed, device=str(dls.train.device), after_ctx=after_ctx, after_unshard=after_unshard)
    (out/f'rank{rank}.json').write_text(json.dumps(res))
    # shut down in order: fastai's distrib_ctx leaves the process group that accelerate made, and a gloo group torn
    # down at interpreter exit can abort the process ("terminate called without an active exception")
    for dl in learn.dls.loaders: dl.close()
    if torch.distributed.is_initialized(): torch.distributed.destroy_process_group()


def check(out:Path, n_train:int=61, n_valid:int=23, bs:int=4, world:int=2)->str:
    "Assert what the `world` ranks of `main` (with its defaults) saw, from their JSON files in `out`; a one-line summary"
    from dali_fastai.loader import batches_per_rank
    ranks = [json.loads((Path(out)/f'rank{i}.json').read_text()) for i in range(world)]
    a = ranks[0]
    lens = [batches_per_rank(n_train, bs, world, drop_last=True), batches_per_rank(n_valid, bs, world, pad=True)]
    assert all(r['lens'] == lens for r in ranks), f"every rank {lens[0]} full training batches, {lens[1]} validation batches"
    assert len({r['seed'] for r in ranks}) == 1 and a['seed'] is not None, "a seed drawn on rank 0 and shared"
    for e in range(2):
        train = [r['seen']['train'][e] for r in ranks]
        every = [i for t in train for i in t]
        assert all(len(t) == lens[0]*bs for t in train)
        assert len(set(every)) == len(every) and set(every) <= set(range(n_train)), "disjoint shards, no repeats"
        # validation batches are gathered: every rank sees every item once, in order
        assert all(r['seen']['valid'][e] == list(range(n_train, n_train + n_valid)) for r in ranks)
    assert a['seen']['train'][0] != a['seen']['train'][1], "a new order every epoch"
    assert all(r['targs'] == list(range(n_train, n_train + n_valid)) for r in ranks), "get_preds: every item, in order"
    assert all(r['ddp_valid'] == a['ddp_valid'] for r in ranks)
    assert all(math.isclose(r['weights'], a['weights'], rel_tol=1e-9) for r in ranks), \
        f"the same weights on every rank after the fit (DDP averaged every step's gradients): {[r['weights'] for r in ranks]}"
    assert all(r['restored'] == [1]*len(r['restored']) for r in ranks), "the metrics kept after a fit hold one value each, not one a rank"
    assert sum(r['after_ctx'] for r in ranks) == n_valid, "right after the context, learn.dls still read the shards"
    assert all(r['after_unshard'] == n_valid for r in ranks), "shard(0, 1) takes the whole set back"
    assert all(math.isclose(d, w, rel_tol=1e-5) for d,w in zip(a['ddp_valid'], a['whole_valid'])), "metrics of the whole validation set"
    return (f"{world} ranks, devices {[r['device'] for r in ranks]}; lens {lens}; train items an epoch {len(set(every))} unique of "
            f"{len(every)}; valid on every rank = items {n_train}..{n_train + n_valid - 1} in order; "
            f"DDP valid {a['ddp_valid']} = one process {a['whole_valid']}")


if __name__ == '__main__':
    if sys.argv[1:2] == ['--check']:
        print(check(Path(sys.argv[2]), world=int(sys.argv[3]) if len(sys.argv) > 3 else 2,
                    n_train=int(sys.argv[4]) if len(sys.argv) > 4 else 61, bs=int(sys.argv[5]) if len(sys.argv) > 5 else 4))
    else: main()
