"""Where the session bench's `fine_tune` epochs go, and what bounds them: one fresh process on the session bench's folder
and learner (`FastStep(graph=True)`), GPU synced at each phase's ends (so the phases add up):

    python tools/fit_phases.py [--decode-on auto|gpu] [--read-valid] [--eager-forward]

Prints, for `fine_tune(3)` (one frozen epoch, three unfrozen), each epoch's seconds, its training and its validation
pass; then, side by side on the same unfrozen learner, the training step's images per second fed a synthetic batch kept
on the GPU (`SyntheticLoader`: the step alone) and fed by the training loader, and the loader alone (images per second it
delivers with no step). The validation loader keeps its pass (the default on a GPU); `--read-valid` reads it through DALI
every epoch (`val_keep_batches=False`); `--eager-forward`: `FastStep` runs the inference forward uncaptured (its
`ForwardCapture` off; training is still captured). GPU only.

Under DDP, each rank reading its shard (`DaliDistributed`, `distrib_ctx(sync_bn=False)`), the epochs alone (rank 0 prints):

    torchrun --nproc_per_node N tools/fit_phases.py [--eager-forward]     # N >= 2

On one GPU, `--wrap-ddp` wraps the model in DDP for each fit over a one-process NCCL group, as fastai's DistributedTrainer
does on several GPUs (under torchrun with one process its Accelerator wraps nothing, and fastai's `after_fit` then fails
unwrapping it; the wrapper here is a DistributedTrainer, so `DaliDistributed` makes the gradient nodes DDP keeps on the
loader's stream, as under fastai): what DDP's wrapping costs the epochs, with and without `--eager-forward`, and, side by
side on the same learner, the step fed by the training loader unwrapped, wrapped, and wrapped with DDP's gradients as
views of its buckets (`gradient_as_bucket_view=True`); `--bucket-view` wraps the epochs' fits that way too."""
import argparse, contextlib, os, socket, time, warnings


def main(decode_on:str='auto', keep_batches:bool=True, eager_forward:bool=False, wrap_ddp:bool=False, bucket_view:bool=False):
    warnings.filterwarnings('ignore')
    import torch
    from fastai.callback.core import Callback
    from fastai.data.core import DataLoaders
    from dali_fastai.faststep import FastStep
    from dali_fastai.sessionbench import _task_data, _quiet
    from dali_fastai.data import DaliDataLoaders
    from dali_fastai.measure import SyntheticLoader, learner_throughput, loader_throughput
    from dali_fastai.distributed import DaliDistributed
    from fastai.distributed import distrib_ctx, DistributedTrainer  # noqa: F401 (adds Learner.distrib_ctx)
    ddp,rank = int(os.environ.get('WORLD_SIZE', 1)) > 1,int(os.environ.get('RANK', 0))
    t,src,db = _task_data('classification', None, 224)
    device = torch.device('cuda', int(os.environ.get('LOCAL_RANK', 0)))
    dls = DaliDataLoaders.from_dblock(db, src, bs=64, device=device, seed=0, decode_on=decode_on, val_keep_batches=keep_batches)
    fs = FastStep(graph=True)
    if eager_forward: fs.forwards = None

    class WrapInDDP(DistributedTrainer):
        "fastai's DistributedTrainer's wrapping of the model for a fit (after `DaliDistributed`'s `before_fit`, as there), `views`: gradients as bucket views; None: no wrapping"
        def __init__(self, views:bool|None=False): self.views = views
        def before_fit(self):
            if self.views is not None: self.learn.model = torch.nn.parallel.DistributedDataParallel(self.learn.model, device_ids=[device], gradient_as_bucket_view=self.views)
        def after_fit(self):
            if isinstance(self.learn.model, torch.nn.parallel.DistributedDataParallel): self.learn.model = self.learn.model.module
        def before_train(self): pass
        def before_validate(self): pass

    wrap = WrapInDDP(bucket_view)
    if wrap_ddp:
        if ddp: raise SystemExit("--wrap-ddp wraps the model in a one-process group: run it without torchrun (under torchrun with "
                                 "several processes fastai's distrib_ctx wraps it)")
        with socket.socket() as s: s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]
        torch.distributed.init_process_group('nccl', init_method=f'tcp://127.0.0.1:{port}', rank=0, world_size=1, device_id=device)
    learn = t.learner(dls, [fs, *([DaliDistributed()] if ddp or wrap_ddp else []), *([wrap] if wrap_ddp else [])], metric=True, size=224)
    sync,clock = torch.cuda.synchronize,time.perf_counter

    class Phases(Callback):
        order = 100
        def __init__(self): self.rows = []
        def _t(self): sync(); return clock()
        def before_epoch(self): self.row = {'epoch': self._t()}
        def before_train(self): self.row['train'] = self._t()
        def after_train(self): self.row['train'] = self._t() - self.row['train']
        def before_validate(self): self.row['valid'] = self._t()
        def after_validate(self): self.row['valid'] = self._t() - self.row['valid']
        def after_epoch(self): self.row['epoch'] = self._t() - self.row['epoch']; self.rows.append(self.row)

    ph = Phases()
    with learn.distrib_ctx(sync_bn=False) if ddp else contextlib.nullcontext(), _quiet(learn): learn.fine_tune(3, cbs=ph)
    if rank: return
    under = f" under DDP on {os.environ['WORLD_SIZE']} GPUs, each rank's shard" if ddp else f" wrapped in DDP (one process{', gradients as bucket views' if bucket_view else ''})" if wrap_ddp else ''
    print(f"fine_tune(3){under}, decode_on={decode_on!r}, val_keep_batches={keep_batches}, eager_forward={eager_forward}: " + '; '.join(
        f"epoch {i} {r['epoch']:.3f} s (train {r['train']:.3f}, valid {r['valid']:.3f})" for i,r in enumerate(ph.rows)))
    print(f"  batches an epoch: train {len(dls.train)}, valid {len(dls.valid)}; decoding now {dls.train.decoding}; "
          f"inference forwards replayed {fs.forwards.replays if fs.forwards else 0}; captures {fs.capture_seconds:.2f} s")
    for said in sorted(fs._warned): print(f"  FastStep said: {said}")
    if ddp: return  # the step's side-by-side rates are one GPU's
    if wrap_ddp: return _wrapped_steps(learn, wrap)
    steps = {}
    syn = DataLoaders(SyntheticLoader(64, 224, dls.c, device, n=60), SyntheticLoader(64, 224, dls.c, device, n=2), device=device)
    real_dls = learn.dls
    for name,d in (('synthetic batch on the GPU', syn), ('the training loader', real_dls)):
        learn.dls = d
        with _quiet(learn): steps[name] = learner_throughput(learn, n_batches=40, warmup=10, passes=3)
    learn.dls = real_dls
    loader = loader_throughput(dls.train.new(), device, n_batches=40, warmup=10, passes=3)
    print("  images/s: " + ', '.join(f"step fed a {k} {v:,.0f}" if k.startswith('synthetic') else f"step fed by {k} {v:,.0f}"
                                     for k,v in steps.items()) + f", the loader alone {loader:,.0f}")


def _wrapped_steps(learn, wrap):
    "The step fed by the training loader, side by side: the model unwrapped, wrapped in DDP, wrapped with bucket views; ends the group"
    import torch
    from dali_fastai.sessionbench import _quiet
    from dali_fastai.measure import learner_throughput
    rates = {}
    for name,views in (('unwrapped', None), ('DDP', False), ('DDP, bucket views', True), ('unwrapped again', None)):
        wrap.views = views
        try:
            with _quiet(learn): rates[name] = f"{learner_throughput(learn, n_batches=40, warmup=10, passes=3):,.0f}"
        except RuntimeError as e: rates[name] = f"failed ({str(e).splitlines()[0]})"
    torch.distributed.destroy_process_group()
    print("  images/s, the step fed by the training loader: " + ', '.join(f"{k} {v}" for k,v in rates.items()))


if __name__ == '__main__':
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--decode-on', default='auto', choices=['auto', 'gpu', 'cpu'])
    p.add_argument('--read-valid', action='store_true', help="validation read through DALI every epoch (val_keep_batches=False)")
    p.add_argument('--eager-forward', action='store_true', help="the inference forward uncaptured (FastStep's ForwardCapture off)")
    p.add_argument('--wrap-ddp', action='store_true', help="one GPU: the model wrapped in DDP for each fit (a one-process NCCL group)")
    p.add_argument('--bucket-view', action='store_true', help="with --wrap-ddp: the epochs' DDP built with gradient_as_bucket_view=True")
    a = p.parse_args()
    if a.bucket_view and not a.wrap_ddp: raise SystemExit("--bucket-view builds the DDP of --wrap-ddp: give both")
    main(a.decode_on, not a.read_valid, a.eager_forward, a.wrap_ddp, a.bucket_view)
