"""A pretrained learner's first validation, its pass read ahead anew after `vision_learner`'s `Normalize` or not. GPU only:

    python tools/read_ahead_anew.py              # the loaders as they are: the pass for the new settings read ahead
    python tools/read_ahead_anew.py --no-anew    # only the first read ahead (before the Normalize): the old behaviour

One fresh process on the session bench's folder (5,000 JPEGs), fastai's usual classification DataBlock without a
`Normalize` (so `vision_learner`, pretrained, adds ImageNet's, which gives validation another pipeline), ResNet-18 with
`FastStep()`. The machine has no network: random weights are saved under torchvision's file name for resnet18's
ImageNet weights (in torch's hub cache), which `vision_learner(pretrained=True)` then loads; what is timed does not
depend on the weights' values. Prints the seconds of 'loaders + learner' (the thread reading ahead joined), of
`fine_tune(1)`, each validation pass, and whether the validation pass was kept before the fit."""
import argparse, os, time, warnings


def main(anew:bool=True):
    warnings.filterwarnings('ignore')
    import torch, torchvision
    from fastai.callback.core import Callback
    from fastai.metrics import accuracy
    from fastai.vision.all import (DataBlock, ImageBlock, CategoryBlock, get_image_files, parent_label, GrandparentSplitter,
                                   RandomResizedCrop, aug_transforms, vision_learner)
    from dali_fastai.data import DaliDataLoaders
    from dali_fastai.epoch import reads_ahead_done
    from dali_fastai.faststep import FastStep
    from dali_fastai.loader import DaliDataLoader
    from dali_fastai.measure import bench_images
    from dali_fastai.sessionbench import _quiet
    path = bench_images(n_per_class=500)
    weights = os.path.join(torch.hub.get_dir(), 'checkpoints', 'resnet18-f37072fd.pth')
    if not os.path.exists(weights):
        os.makedirs(os.path.dirname(weights), exist_ok=True)
        torch.save(torchvision.models.resnet18().state_dict(), weights)
    db = DataBlock(blocks=(ImageBlock, CategoryBlock), get_items=get_image_files, get_y=parent_label,
                   splitter=GrandparentSplitter(valid_name='valid'), item_tfms=RandomResizedCrop(224), batch_tfms=aug_transforms())
    torch.zeros(1, device='cuda')
    first = DaliDataLoader.read_ahead
    if not anew: DaliDataLoader.read_ahead = lambda self: None  # a probe's switch: the loaders' own call, and `_rebuilt`'s
    sync,clock = torch.cuda.synchronize,time.perf_counter
    start = clock()
    dls = DaliDataLoaders.from_dblock(db, path, bs=64, device='cuda', seed=0)
    if not anew: first(dls.valid)  # the first read ahead, as `from_items` does; none after the Normalize
    learn = vision_learner(dls, torchvision.models.resnet18, pretrained=True, metrics=accuracy, cbs=[FastStep()]).to_bf16()
    reads_ahead_done()
    built = clock() - start
    kept = dls.valid._kept() is not None

    class Validations(Callback):
        order = 100
        def __init__(self): self.secs = []
        def before_validate(self): sync(); self.start = clock()
        def after_validate(self): sync(); self.secs.append(clock() - self.start)

    v = Validations()
    start = clock()
    with _quiet(learn): learn.fine_tune(1, cbs=v)
    sync()
    print(f"{'read ahead anew' if anew else 'not read ahead anew'}: loaders + learner {built:.3f} s, fine_tune(1) {clock() - start:.3f} s, "
          f"validations {', '.join(f'{s:.3f}' for s in v.secs)} s; validation kept before the fit: {kept}")


if __name__ == '__main__':
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--no-anew', action='store_true', help="read the first pass ahead before the Normalize only")
    main(not p.parse_args().no_anew)
