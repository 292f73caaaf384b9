"""`dali-fastai train --gpus N` against one GPU: the same final metrics, within the seeds' spread.

    python tools/gpus_accuracy.py [--gpus 2] [--seeds 0 1 2] [--epochs 4] [--bs 64] [--size 128] [--path FOLDER]

For each seed, the command line trains resnet18 from scratch (`--fast-step`) once on one GPU at `--bs` and once on `--gpus`
GPUs at `--bs / --gpus` a GPU: the same global batch, hence the same number of steps and the same one-cycle schedule, as
a user scaling out keeps it. Default data: the bench's photo set (`bench_images(n_per_class=300)`, 10 classes). Prints
each run's final validation accuracy and loss, each count's mean and spread (max - min over the seeds), and whether the
means differ by no more than the larger spread. GPU only (the several-GPU runs go through torchrun, as `--gpus` does).
"""
import argparse, re, statistics, subprocess, sys

from dali_fastai.measure import bench_images

DONE = re.compile(r'^done: .*\| valid_loss (?P<loss>[\d.]+) \| accuracy (?P<acc>[\d.]+)', re.M)


def train_line(path:str, gpus:int, seed:int, epochs:int, bs:int, size:int)->dict:
    "Final validation loss and accuracy of `dali-fastai train` on `gpus` GPUs (`bs` is the global batch)"
    argv = ['train', path, '--gpus', str(gpus), '--seed', str(seed), '--epochs', str(epochs), '--bs', str(bs // gpus),
            '--size', str(size), '--fast-step']
    r = subprocess.run([sys.executable, '-c', 'from dali_fastai.cli import main; main()', *argv], capture_output=True,
                       text=True, timeout=900)
    m = DONE.search(r.stdout)
    if r.returncode != 0 or m is None:
        raise RuntimeError(f"train {' '.join(argv)} ended with exit code {r.returncode} and no final line:\n{r.stderr[-2000:]}")
    return dict(loss=float(m['loss']), accuracy=float(m['acc']))


def main():
    p = argparse.ArgumentParser()
    p.add_argument('--gpus', type=int, default=2); p.add_argument('--seeds', type=int, nargs='+', default=[0, 1, 2])
    p.add_argument('--epochs', type=int, default=4); p.add_argument('--bs', type=int, default=64)
    p.add_argument('--size', type=int, default=128); p.add_argument('--path', default=None)
    a = p.parse_args()
    path = a.path or str(bench_images(n_per_class=300))
    res = {}
    for n in (1, a.gpus):
        res[n] = [train_line(path, n, s, a.epochs, a.bs, a.size) for s in a.seeds]
        for s,r in zip(a.seeds, res[n]):
            print(f"{n} GPU(s), bs {a.bs // n}/GPU, seed {s}: accuracy {r['accuracy']:.4f}, valid loss {r['loss']:.4f}", flush=True)
    accs = {n: [r['accuracy'] for r in rs] for n,rs in res.items()}
    spread = {n: max(v) - min(v) for n,v in accs.items()}
    gap = abs(statistics.mean(accs[a.gpus]) - statistics.mean(accs[1]))
    for n,v in accs.items(): print(f"{n} GPU(s): accuracy mean {statistics.mean(v):.4f}, spread {spread[n]:.4f} over seeds {a.seeds}")
    print(f"means differ by {gap:.4f}: {'within' if gap <= max(spread.values()) else 'OUTSIDE'} the seeds' spread ({max(spread.values()):.4f})")


if __name__ == '__main__': main()
