"""Boxes and points follow every geometric augmentation: images whose objects are solid coloured rectangles at known
boxes go through `DaliDataLoaders.from_dblock` with each fastai transform alone (p=1) and with `aug_transforms()`; every
output box must enclose its colour's region tightly, every point must sit on its rectangle's centre, on the CPU backend
(and on the GPU backend with `DALI_FASTAI_TEST_DEVICE=gpu`, as `make gpu-test` runs it); the same from WebDataset and
TFRecord shards written by `dblock_shards`."""
import math, os
import numpy as np
import pytest
import torch
from fastai.vision.all import (DataBlock, ImageBlock, BBoxBlock, BBoxLblBlock, PointBlock, FuncSplitter, Resize,
                               RandomResizedCrop, Flip, Dihedral, Rotate, Zoom, Warp, aug_transforms, TensorBBox,
                               TensorMultiCategory, TensorPoint)
from PIL import Image

from dali_fastai.data import DaliDataLoaders
from dali_fastai.steps import RandomBoxCrop
from helpers import assert_resume_replays, needs_gpu

DEVICE = os.environ.get('DALI_FASTAI_TEST_DEVICE', 'cpu')
H, W = 96, 128
COLOURS = {'red': (230, 20, 20), 'green': (20, 220, 20), 'blue': (20, 20, 230)}
N = 8


def scene(i:int)->tuple:
    "Image `i`: grey, with one to three rectangles of pure colours, 24-32 pixels a side, one in each third of the width"
    rng = np.random.default_rng(i)
    img = np.full((H, W, 3), 128, np.uint8)
    boxes,labels = [],[]
    for slot,name in zip(rng.permutation(3)[:1 + i % 3], rng.permutation(list(COLOURS))):
        w,h = rng.integers(24, 33),rng.integers(24, 33)
        l,t = 8 + slot*40 + rng.integers(0, 36 - w + 1),rng.integers(12, H - 12 - h)
        img[t:t + h, l:l + w] = COLOURS[name]
        boxes.append([float(l), float(t), float(l + w), float(t + h)]); labels.append(str(name))
    return img,boxes,labels


@pytest.fixture(scope='module')
def scenes(tmp_path_factory):
    root = tmp_path_factory.mktemp('rects')
    ann = {}
    for i in range(2*N):
        img,boxes,labels = scene(i)
        f = root/f"{'valid' if i >= N else 'train'}_{i:02d}.png"
        Image.fromarray(img).save(f)
        ann[f.name] = (boxes, labels)
    return root,ann


def box_dblock(ann:dict, item_tfms, batch_tfms=None, pattern:str='*.png')->DataBlock:
    "fastai's detection DataBlock over the files matching `pattern`, boxes and labels from `ann`, `valid_*` files validating"
    return DataBlock(blocks=(ImageBlock, BBoxBlock, BBoxLblBlock), get_items=lambda p: sorted(p.glob(pattern)),
                     get_y=[lambda o: ann[o.name][0], lambda o: ann[o.name][1]], n_inp=1,
                     splitter=FuncSplitter(lambda o: o.name.startswith('valid')), item_tfms=item_tfms, batch_tfms=batch_tfms)


def loaders(scenes, item_tfms, batch_tfms, blocks=(ImageBlock, BBoxBlock, BBoxLblBlock), **kw):
    root,ann = scenes
    get_y = ([lambda o: ann[o.name][0], lambda o: ann[o.name][1]] if BBoxBlock in blocks else
             lambda o: [[(b[0] + b[2])/2, (b[1] + b[3])/2] for b in ann[o.name][0][:1]])
    dblock = DataBlock(blocks=blocks, get_items=lambda p: sorted(p.glob('*.png')), get_y=get_y, n_inp=1,
                       splitter=FuncSplitter(lambda o: o.name.startswith('valid')), item_tfms=item_tfms, batch_tfms=batch_tfms)
    return DaliDataLoaders.from_dblock(dblock, root, **{'bs': N, 'device': DEVICE, 'seed': 0, **kw})


def region(img:np.ndarray, colour)->np.ndarray|None:
    "ltrb pixel edges of the pixels of `img` (HWC, 0..1) nearest `colour`; None when there are too few"
    close = np.abs(img - np.array(colour)/255).max(-1) < 0.2
    ys,xs = np.nonzero(close)
    return None if len(xs) < 12 else np.array([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1], np.float64)


def iou(a, b)->float:
    w,h = min(a[2], b[2]) - max(a[0], b[0]),min(a[3], b[3]) - max(a[1], b[1])
    inter = max(w, 0)*max(h, 0)
    return inter/((a[2] - a[0])*(a[3] - a[1]) + (b[2] - b[0])*(b[3] - b[1]) - inter)


def check_boxes(dl, min_iou:float, batches:int=1):
    "Every kept box encloses its colour's region with IoU ≥ `min_iou`; every colour region that is there has its box"
    vocab,seen = dl.vocab,0
    for _,(x,boxes,labels) in zip(range(batches), dl):
        assert isinstance(boxes, TensorBBox) and isinstance(labels, TensorMultiCategory)
        h,w = x.shape[-2:]
        for img,bs,ls in zip(x.permute(0, 2, 3, 1).cpu().numpy(), boxes.cpu().numpy(), labels.cpu().numpy()):
            named = {vocab[l]: (b + 1)*np.array([w, h, w, h])/2 for b,l in zip(bs, ls) if l != 0}
            for name,colour in COLOURS.items():
                r = region(img, colour)
                if r is None or min(r[2] - r[0], r[3] - r[1]) < 8: continue  # cut away, or a sliver at the border
                assert name in named, f"the {name} rectangle is in the image but its box was dropped"
                assert iou(named[name], r) >= min_iou, (name, named[name], r, iou(named[name], r))
                seen += 1
    assert seen >= N, f"only {seen} boxes checked"


CASES = {  # name: (item_tfms, batch_tfms, IoU bound); boxes of 20-40 output pixels, so that a region's whole-pixel edges
    # (half a pixel off the true edge at worst) keep the IoU of an exact box above 0.9
    'resize crop': (Resize(96), [], 0.9),
    'resize pad': (Resize(96, method='pad', pad_mode='zeros'), [], 0.9),
    'resize squish': (Resize(96, method='squish'), [], 0.9),
    'random resized crop': (RandomResizedCrop(96, min_scale=0.5), [], 0.9),
    'random box crop': (RandomBoxCrop(96), [], 0.9),
    'flip': (Resize(96), [Flip(p=1.)], 0.9),
    'dihedral': (Resize(96), [Dihedral(p=1.)], 0.9),
    'zoom': (Resize(96), [Zoom(min_zoom=1.1, max_zoom=1.4, p=1.)], 0.9),
    'rotate': (Resize(96), [Rotate(max_deg=25, p=1.)], 0.7),
    'warp': (Resize(96), [Warp(magnitude=0.3, p=1.)], 0.7),
    'aug_transforms': (Resize(112), aug_transforms(size=96), 0.7),
    # height and width differ at every step (the images are 96x128): scaling x by the height, or y by the width, moves the boxes
    'resize squish 96x160': (Resize((96, 160), method='squish'), [], 0.9),
    'resize crop 80x128': (Resize((80, 128)), [], 0.9),
    'resize pad 112x128': (Resize((112, 128), method='pad', pad_mode='zeros'), [], 0.9),
    'flip 96x160': (Resize((96, 160), method='squish'), [Flip(p=1.)], 0.9),
    'zoom 96x160': (Resize((96, 160), method='squish'), [Zoom(min_zoom=1.1, max_zoom=1.3, p=1.)], 0.9),
    'rotate 96x160': (Resize((96, 160), method='squish'), [Rotate(max_deg=20, p=1.)], 0.7),
    'aug_transforms 96x144': (Resize((112, 160)), aug_transforms(size=(96, 144), pad_mode='zeros'), 0.7),  # no mirrored rectangles
}


@pytest.mark.parametrize('case', list(CASES))
def test_boxes_follow_the_augmentation(scenes, case):
    item,batch,bound = CASES[case]
    dls = loaders(scenes, item, batch)
    check_boxes(dls.train, bound, batches=2)
    check_boxes(dls.valid, 0.9)


@pytest.mark.parametrize('size', [96, (96, 160)], ids=['square', '96x160'])
def test_points_follow_the_augmentation(scenes, size):
    "A point on a rectangle's centre stays on the centre of its moved rectangle, within 1.5 pixels (square and wide batches)"
    dls = loaders(scenes, Resize(size, method='squish'), aug_transforms(size=size, max_rotate=20., max_warp=0.),
                  blocks=(ImageBlock, PointBlock), shuffle=False)  # the batch in the items' order
    root,ann = scenes
    x,pts = dls.train.one_batch()
    assert isinstance(pts, TensorPoint) and pts.shape == (N, 1, 2)
    h,w = x.shape[-2:]
    checked = 0
    for img,p,f in zip(x.permute(0, 2, 3, 1).cpu().numpy(), pts.cpu().numpy(), dls.train.items.files):
        name = ann[f.name][1][0]
        close = np.abs(img - np.array(COLOURS[name])/255).max(-1) < 0.2
        ys,xs = np.nonzero(close)
        if len(xs) < 100 or xs.min() == 0 or ys.min() == 0 or xs.max() == w - 1 or ys.max() == h - 1: continue  # cut by the border
        centre = np.array([xs.mean() + 0.5, ys.mean() + 0.5])
        assert np.abs((p[0] + 1)*np.array([w, h])/2 - centre).max() <= 1.5, (f.name, p, centre)
        checked += 1
    assert checked >= N//2


def test_no_augmentation_matches_fastai_bb_pad(scenes):
    "Validation batches (no augmentation): the same padded boxes and #na#-padded labels as fastai's own loaders"
    root,ann = scenes
    dls = loaders(scenes, Resize(96, method='squish'), [])
    dblock = box_dblock(ann, Resize(96, method='squish'))
    theirs = dblock.dataloaders(root, bs=N, num_workers=0, device='cpu')
    assert dls.vocab == theirs.vocab
    (_,b,l),(_,fb,fl) = dls.valid.one_batch(),theirs.valid.one_batch()
    assert torch.equal(l.cpu(), fl.cpu())
    assert (b.cpu() - fb.cpu()).abs().max() < 1e-5


def test_labels_must_match_boxes(scenes):
    root,ann = scenes
    bad = {k: (b, l[:-1] if len(l) > 1 else l) for k,(b,l) in ann.items()}
    first = next(k for k in sorted(ann) if k.startswith('train') and len(ann[k][1]) > 1)
    dblock = box_dblock(bad, Resize(96))
    n = len(ann[first][1])
    with pytest.raises(ValueError, match=rf"{first}: {n} boxes but {n - 1} labels"):
        DaliDataLoaders.from_dblock(dblock, root, bs=N, device='cpu')


def test_boxes_need_a_sizing_item_transform(scenes):
    with pytest.raises(ValueError, match=r'add Resize\(\.\.\.\)'): loaders(scenes, None, None).train.one_batch()


def test_show_batch_decodes_as_fastai(scenes):
    "Decoded samples: the image, the boxes in its pixels, and the boxes with their class names (#na# on padding), as fastai's"
    root,ann = scenes
    dls = loaders(scenes, Resize(96, method='squish'), [])
    dblock = box_dblock(ann, Resize(96, method='squish'))
    theirs = dblock.dataloaders(root, bs=N, num_workers=0, device='cpu')
    ours,want = dls.valid.show_batch(show=False)[2],theirs.valid.show_batch(show=False)[2]
    for o,w in zip(ours, want):
        assert [type(a).__name__ for a in o] == [type(a).__name__ for a in w] == ['TensorImage', 'TensorBBox', 'LabeledBBox']
        assert (o[1] - w[1]).abs().max() < 1e-3 and o[2].lbl == w[2].lbl
    import matplotlib; matplotlib.use('Agg')
    dls.train.show_batch(max_n=4)  # draws


def test_a_detector_learns_from_dali_batches(tmp_path):
    "A torchvision detector in a fastai Learner fits an epoch on the embedded scenes from DALI's batches; export and load"
    pytest.importorskip('pycocotools', reason="the detector's mAP metric needs pycocotools (in the project's dev extras)")
    from fastai.learner import load_learner
    from dali_fastai.annotations import read_coco
    from dali_fastai.detectors import small_detector
    from dali_fastai.detection import detection_learner
    from dali_fastai.scenes import fashion_scenes
    p = fashion_scenes(tmp_path/'scenes', n_train=16, n_valid=8, size=96, progress=False)
    ann = {r.file.name: (r.boxes.tolist(), r.labels) for s in ('train', 'valid')
           for r in read_coco(p/'annotations'/f'{s}.json', p/'JPEGImages')[0]}
    dblock = box_dblock(ann, Resize(96), aug_transforms(size=64), pattern='*.jpg')
    dls = DaliDataLoaders.from_dblock(dblock, p/'JPEGImages', bs=8, val_bs=4, device='cpu', seed=0)
    learn = detection_learner(dls, small_detector(len(dls.vocab), (64, 64), score_thresh=0.))
    learn.fit(1, 1e-3)
    assert all(math.isfinite(v) for v in learn.recorder.values[-1])
    import matplotlib; matplotlib.use('Agg')
    learn.show_results(max_n=2)  # targets beside predictions, as fastai draws them
    boxes,labels,scores = learn.get_preds()[0]  # two validation batches, gathered
    assert isinstance(boxes, TensorBBox) and boxes.shape[:2] == labels.shape == scores.shape and len(boxes) == 8
    learn.export(tmp_path/'det.pkl')
    loaded = load_learner(tmp_path/'det.pkl')
    assert loaded.dls.vocab == dls.vocab and len(loaded.dls.train.items) == 0
    (pixels,named),boxes,_ = loaded.predict(p/'JPEGImages'/'valid_0000.jpg')  # decoded as fastai decodes its box batches
    assert isinstance(pixels, TensorBBox) and type(named).__name__ == 'LabeledBBox'
    assert len(named.lbl) == boxes.shape[1] and set(named.lbl) <= set(dls.vocab) and (pixels >= 0).all() and (pixels <= 64).all()


def test_images_without_boxes_kept_or_left_out_of_training(scenes):
    "Images with no box are kept by default (an empty row of padding); keep_empty=False leaves them out of training only"
    root,ann = scenes
    empty = {**ann, 'train_00.png': ([], []), 'valid_08.png': ([], [])}
    dblock = box_dblock(empty, Resize(96))
    kept = DaliDataLoaders.from_dblock(dblock, root, bs=N, device='cpu', shuffle=False)
    assert len(kept.train.items) == N and (kept.train.one_batch()[2][0] == 0).all()  # no box: labels all #na#
    left = DaliDataLoaders.from_dblock(dblock, root, bs=N - 1, device='cpu', keep_empty=False)
    assert 'train_00.png' not in [f.name for f in left.train.items.files] and len(left.valid.items) == N


def test_several_points_follow_the_augmentation(scenes):
    "A rectangle's four corners (TensorPoint [bs, 4, 2]) land on its moved rectangle's corners: on its region's rim, within 1.5 px"
    root,ann = scenes
    corners = lambda o: [[b[0], b[1]], [b[2], b[1]], [b[0], b[3]], [b[2], b[3]]] if (b := ann[o.name][0][0]) else []
    dblock = DataBlock(blocks=(ImageBlock, PointBlock), get_items=lambda p: sorted(p.glob('*.png')), get_y=corners, n_inp=1,
                       splitter=FuncSplitter(lambda o: o.name.startswith('valid')), item_tfms=Resize(96, method='squish'),
                       batch_tfms=aug_transforms(size=96, max_rotate=20., max_warp=0., min_zoom=0.9, max_zoom=1.))
    dls = DaliDataLoaders.from_dblock(dblock, root, bs=N, device=DEVICE, seed=0, shuffle=False)
    x,pts = dls.train.one_batch()
    assert pts.shape == (N, 4, 2)
    h,w = x.shape[-2:]
    checked = 0
    for img,p,f in zip(x.permute(0, 2, 3, 1).cpu().numpy(), pts.cpu().numpy(), dls.train.items.files):
        close = np.abs(img - np.array(COLOURS[ann[f.name][1][0]])/255).max(-1) < 0.2
        ys,xs = np.nonzero(close)
        if len(xs) < 100 or xs.min() == 0 or ys.min() == 0 or xs.max() == w - 1 or ys.max() == h - 1: continue
        centres = np.stack([xs + 0.5, ys + 0.5], 1)
        for q in (p + 1)*np.array([w, h])/2:  # each corner: a region pixel's centre within 1.5 px
            assert np.sqrt(((centres - q)**2).sum(1)).min() <= 1.5, (f.name, q)
        checked += 1
    assert checked >= N//2


def test_resume_replays_the_same_boxes(scenes):
    "A loader restored from `state_dict` mid-epoch yields the same augmented images and the same boxes and labels"
    assert_resume_replays(loaders(scenes, Resize(96), aug_transforms(size=96), bs=4).train)


@pytest.mark.parametrize('fastai_loader', [False, True])
def test_random_box_crop_keeps_the_object(scenes, fastai_loader):
    "`RandomBoxCrop(min_ious=(0.5,))` on images of one object: every window overlaps the box by IoU >= 0.5, so the box is never dropped; a plain RandomResizedCrop drops some. The same in fastai's own loader"
    root,ann = scenes
    ones = sorted(f for f in root.glob('train_*.png') if len(ann[f.name][0]) == 1)
    seen = {l for o in ones for l in ann[o.name][1]}
    valid = next(f for f in sorted(root.glob('valid_*.png')) if set(ann[f.name][1]) <= seen)  # fastai needs its labels in training
    def n_boxes(item):  # boxes in 30 epochs of training batches
        d = DataBlock(blocks=(ImageBlock, BBoxBlock, BBoxLblBlock), get_items=lambda _: ones + [valid], n_inp=1,
                      get_y=[lambda o: ann[o.name][0], lambda o: ann[o.name][1]], item_tfms=item,
                      splitter=FuncSplitter(lambda o: o.name.startswith('valid')))
        dl = (d.dataloaders(root, bs=len(ones), num_workers=0, shuffle=False, drop_last=False) if fastai_loader else
              DaliDataLoaders.from_dblock(d, root, bs=len(ones), device=DEVICE, seed=0, val_bs=1, drop_last=False)).train
        return sum(int((lbl != 0).sum()) for _ in range(30) for _,_,lbl in dl)
    assert len(ones) >= 2
    assert n_boxes(RandomBoxCrop(96, min_ious=(0.5,), allow_no_crop=False)) == 30*len(ones)
    assert n_boxes(RandomResizedCrop(96, min_scale=0.08)) < 30*len(ones)


@pytest.mark.parametrize('fmt', ['webdataset', 'tfrecord'])
def test_boxes_and_points_from_shards(scenes, tmp_path, fmt):
    "Box and point DataBlocks written with `dblock_shards`: validation batches equal `from_dblock`'s; boxes follow aug_transforms"
    from dali_fastai.shards import dblock_shards
    root,ann = scenes
    make = {'webdataset': DaliDataLoaders.from_webdataset, 'tfrecord': DaliDataLoaders.from_tfrecord}[fmt]
    dblock_shards(box_dblock(ann, None), root, tmp_path/'boxes', shard_size=5, progress=False, format=fmt)
    kw = dict(bs=N, device=DEVICE, seed=0)
    ours = make(tmp_path/'boxes', item_tfms=Resize(96), **kw)
    theirs = DaliDataLoaders.from_dblock(box_dblock(ann, Resize(96)), root, **kw)
    assert ours.vocab == theirs.vocab
    for a,b in zip(ours.valid, theirs.valid):
        for u,v in zip(a, b): assert type(u) is type(v) and torch.equal(u, v)
    check_boxes(make(tmp_path/'boxes', item_tfms=Resize(112), batch_tfms=aug_transforms(size=96), **kw).train, 0.7, batches=2)
    centre = lambda o: [[(b[0] + b[2])/2, (b[1] + b[3])/2] for b in ann[o.name][0][:1]]
    points = DataBlock(blocks=(ImageBlock, PointBlock), get_items=lambda p: sorted(p.glob('*.png')), get_y=centre, n_inp=1,
                       splitter=FuncSplitter(lambda o: o.name.startswith('valid')), item_tfms=Resize(96))
    dblock_shards(points, root, tmp_path/'points', shard_size=5, progress=False, format=fmt)
    a = make(tmp_path/'points', item_tfms=Resize(96), **kw).valid.one_batch()
    b = DaliDataLoaders.from_dblock(points, root, **kw).valid.one_batch()
    assert isinstance(a[1], TensorPoint) and torch.equal(a[0], b[0]) and torch.allclose(a[1], b[1])
    with pytest.raises(ValueError, match=r"RandomBoxCrop reads each item's boxes from a file"):
        make(tmp_path/'boxes', item_tfms=RandomBoxCrop(96), **kw).train.one_batch()


@needs_gpu('a box batch on the GPU')
def test_box_batches_do_not_wait_for_the_gpu(scenes):
    "On the GPU backend the boxes, labels and points are computed on the host from DALI's host outputs, then copied: taking a batch makes no host sync, and gives what the same loader gives on the CPU backend"
    gpu = loaders(scenes, Resize(96, method='squish'), [], device='gpu')
    cpu = loaders(scenes, Resize(96, method='squish'), [], device='cpu')
    next(iter(gpu.valid))  # the pipeline built, the pinned-memory cache warm
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode('error')
    try: batches = list(gpu.valid)
    finally: torch.cuda.set_sync_debug_mode(0)
    (_,b,l),(_,cb,cl) = batches[0],next(iter(cpu.valid))
    assert b.device.type == 'cuda' and l.device.type == 'cuda' and type(b).__name__ == 'TensorBBox'
    assert torch.equal(l.cpu(), cl) and (b.cpu() - cb).abs().max() < 1e-5


def test_boxes_over_the_border_are_clipped_as_fastai_clips_them(tmp_path):
    """Boxes that overhang the image (annotations past its border, and boxes a centre crop cuts) are clipped to it, and a box
    left with no area is dropped with its label, as fastai's `clip_remove_empty` (`bb_pad`) does: the same validation batch"""
    ann = {}
    for i in range(4):
        f = tmp_path/f"{'valid' if i >= 2 else 'train'}_{i}.png"
        Image.fromarray(np.full((H, W, 3), 128, np.uint8)).save(f)
        ann[f.name] = ([[-10., 20., 40., 60.], [100., -5., 140., 30.], [60. + i, 70., 90., 110.], [-30., 10., -5., 40.]],
                       ['red', 'green', 'blue', 'red'])  # past the left, the top-right, the bottom; the last wholly outside
    for item in (Resize(96, method='squish'), Resize(96)):  # squish: past the border; crop: also cut at the sides
        dls = DaliDataLoaders.from_dblock(box_dblock(ann, item), tmp_path, bs=2, device=DEVICE, seed=0)
        theirs = box_dblock(ann, item).dataloaders(tmp_path, bs=2, num_workers=0, device='cpu')
        (_,b,l),(_,fb,fl) = dls.valid.one_batch(),theirs.valid.one_batch()
        assert b.shape == fb.shape == (2, 3, 4) and b.abs().max() <= 1 and (b.abs() == 1).any()
        assert torch.equal(l.cpu(), fl.cpu()) and (b.cpu() - fb.cpu()).abs().max() < 1e-5, (b, fb)
