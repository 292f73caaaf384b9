"""What fastai computing a replayed step's loss again would cost: `FastStep(graph=True)` trains the step captured whole
(forward, loss, backward), and from `after_pred` to `after_loss` fastai's loss function gives the graph's loss; here, side
by side on one learner (the session bench's ResNet-18 at 224 px, bs 64, bf16), the same with that lending switched off,
so fastai computes the loss of the replayed prediction again (the step before 2026-11-29):

    python tools/replayed_loss.py [--rounds 2]

Prints the host time of one call of the task's loss function on a training batch (what the lending saves the host a
step), then images per second of the training step fed a synthetic batch kept on the GPU (the host-bound case) and fed
by the training loader, each way in turn, `--rounds` times. GPU only."""
import argparse, time, warnings


def main(rounds:int=2):
    warnings.filterwarnings('ignore')
    import torch
    from fastai.data.core import DataLoaders
    from dali_fastai.faststep import FastStep
    from dali_fastai.sessionbench import _quiet
    from dali_fastai.stepbench import _task_data
    from dali_fastai.data import DaliDataLoaders
    from dali_fastai.measure import SyntheticLoader, learner_throughput

    class LossAgain(FastStep):
        "`FastStep` with fastai's loss function left in place: fastai computes a replayed step's loss again (`after_loss` takes the graph's)"
        def after_pred(self): pass

    t,src,db = _task_data('classification', None, 224)
    device = torch.device('cuda')
    dls = DaliDataLoaders.from_dblock(db, src, bs=64, device=device, seed=0)
    learn = t.learner(dls, [], metric=False, size=224)
    xb,yb = dls.one_batch()
    pred = learn.model.to(device)(xb).detach()
    n = 200
    torch.cuda.synchronize(); start = time.perf_counter()
    for _ in range(n): learn.loss_func(pred, yb).clone()
    host = (time.perf_counter() - start)/n
    torch.cuda.synchronize()
    print(f"{t.model}, bs 64, {torch.cuda.get_device_name()}: fastai's {type(learn.loss_func).__name__} of a batch, "
          f"host time a call {1e6*host:.0f} us")
    syn = DataLoaders(SyntheticLoader(64, 224, dls.c, device, n=80), SyntheticLoader(64, 224, dls.c, device, n=2), device=device)
    for feed,d in (('synthetic batch on the GPU', syn), ('the training loader', dls)):
        learn.dls = d
        rates = {}
        for _ in range(rounds):
            for name,cb in (('graph loss given', FastStep(graph=True)), ('loss computed again', LossAgain(graph=True))):
                learn.add_cb(cb)
                with _quiet(learn): rates.setdefault(name, []).append(learner_throughput(learn, n_batches=60, warmup=10, passes=3))
                learn.remove_cb(cb)
        print(f"  images/s, step fed a {feed}: " if feed.startswith('synthetic') else f"  images/s, step fed by {feed}: ",
              '; '.join(f"{k} {', '.join(f'{r:,.0f}' for r in v)}" for k,v in rates.items()))


if __name__ == '__main__':
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--rounds', type=int, default=2, help="each way's turns (alternating)")
    main(p.parse_args().rounds)
