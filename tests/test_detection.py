"`dali_fastai.detection` and `dali_fastai.detectors` on CPU: fastai's padded batches to torchvision targets, the batched detectors against torchvision's, a training step, predictions, mAP"
import math, sys, warnings
from contextlib import contextmanager
from types import SimpleNamespace
import matplotlib.pyplot as plt
import pytest
import torch
from fastai.vision.all import TensorBBox, TensorMultiCategory, bb_pad, TensorImage
from dali_fastai.detectors import small_detector, BatchedTransform, BatchedFCOS, BatchedRetinaNet, BoxCheck, padded_targets, unpadded_targets
from dali_fastai.detection import (fastai_to_targets, DetectionAdapter, DetectionTargets, DetectionMAP,
                                   detection_loss, DetectionLoss, padded_detections, unpadded, fastai_to_padded)
from helpers import needs_gpu

H,W = 48, 64

def px_to_fastai(b, h=H, w=W):
    "ltrb pixels -> fastai's [-1, 1] (PointScaler: x*2/size - 1)"
    return torch.tensor(b, dtype=torch.float32).reshape(-1, 4) * 2 / torch.tensor([w, h, w, h]) - 1

@pytest.fixture
def batch():
    "Three images made as fastai's bb_pad makes them: 2 boxes, 1 box, none"
    boxes = [[[0, 0, 32, 24], [40, 10, 64, 48]], [[8, 4, 20, 40]], []]
    labels = [[2, 1], [3], []]
    samples = [(TensorImage(torch.zeros(3, H, W)), TensorBBox(px_to_fastai(b).reshape(-1, 4)), TensorMultiCategory(torch.tensor(l, dtype=torch.long)))
               for b,l in zip(boxes, labels)]
    padded = bb_pad(samples)
    torch.manual_seed(0)
    x = torch.randn(3, 3, H, W)
    return x, TensorBBox(torch.stack([p[1] for p in padded])), TensorMultiCategory(torch.stack([p[2] for p in padded])), boxes, labels

def test_targets_exact(batch):
    x,bx,lb,boxes,labels = batch
    assert bx.shape == (3, 2, 4) and lb[1].tolist() == [3, 0] and lb[2].tolist() == [0, 0]  # bb_pad's padding
    ts = fastai_to_targets(bx, lb, (H, W))
    for t,b,l in zip(ts, boxes, labels):
        assert t['boxes'].shape == (len(b), 4) and t['boxes'].dtype == torch.float32 and type(t['boxes']) is torch.Tensor
        assert torch.allclose(t['boxes'], torch.tensor(b, dtype=torch.float32).reshape(-1, 4), atol=1e-5)
        assert t['labels'].tolist() == l and t['labels'].dtype == torch.int64

def test_targets_refuse_other_shapes(batch):
    _,bx,lb,_,_ = batch
    with pytest.raises(ValueError, match='expected boxes'): fastai_to_targets(bx, lb[:, :1], (H, W))
    with pytest.raises(ValueError, match='expected boxes'): fastai_to_targets(bx[..., :2], lb, (H, W))

def test_callback_passes_targets(batch):
    "The model gets the boxes and labels, zero-padded to the most rows seen (a multiple of 8: few shapes for a CUDA graph); the targets stay as they are"
    x,bx,lb,_,_ = batch
    learn = SimpleNamespace(xb=(x,), yb=(bx, lb))
    cb = DetectionTargets(); cb.learn = learn
    cb.before_batch()
    assert learn.xb[0] is x and learn.yb == (bx, lb)
    assert learn.xb[1].shape == (3, 8, 4) and learn.xb[2].shape == (3, 8)
    assert torch.equal(learn.xb[1][:, :2], bx) and torch.equal(learn.xb[2][:, :2], lb) and not learn.xb[1][:, 2:].any() and not learn.xb[2][:, 2:].any()
    learn.xb,learn.yb = (x,),(bx[:, :1], lb[:, :1])  # fewer rows: padded to the most seen
    cb.before_batch()
    assert learn.xb[1].shape == (3, 8, 4)
    learn.xb,learn.yb = (x,),(torch.zeros(3, 9, 4), torch.zeros(3, 9, dtype=torch.long))
    cb.before_batch()
    assert learn.xb[1].shape == (3, 16, 4) and learn.xb[2].shape == (3, 16)
    model,x = DetectionAdapter(small_detector(4, (64, 96), fpn_channels=64)),torch.randn(3, 3, 64, 96)  # the batched step's size
    padded,plain = model(x, _pad8(bx), _pad8(lb)),model(x, bx, lb)  # zero rows change no loss
    for k in plain['losses']: assert torch.allclose(padded['losses'][k], plain['losses'][k]), k

def _pad8(t): return torch.cat([t, t.new_zeros(t.shape[0], 8 - t.shape[1], *t.shape[2:])], 1)

@pytest.mark.parametrize('arch', ['fcos', 'retinanet'])
def test_train_step_and_predictions(batch, arch):
    x,bx,lb,_,_ = batch
    torch.manual_seed(0)
    # score_thresh=0: the untrained model's detections all count, so the decoding below runs on real, non-square boxes
    model = DetectionAdapter(small_detector(4, (H, W), arch=arch, fpn_channels=64, score_thresh=0.))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss = detection_loss(model(x, bx, lb), bx, lb)
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward(); opt.step()
    model.eval()
    with torch.no_grad(): out = model(x, bx, lb)
    d = out['detections']
    assert set(d) == {'boxes', 'scores', 'labels'} and d['boxes'].shape == (3, model.max_detections, 4)
    assert len(unpadded(d)) == 3 and all(len(u['labels']) == int((s > 0).sum()) for u,s in zip(unpadded(d), d['scores']))
    assert torch.isfinite(detection_loss(out))
    boxes,labels,scores = DetectionLoss().activation(out)  # fastai's coordinates, zeros and #na# past the detections
    real = scores > 0
    assert real.sum() >= 10, "the check below needs detections"
    px = d['boxes'][real]
    assert (px[:, 2] - px[:, 0] != px[:, 3] - px[:, 1]).any() and px[:, [0, 2]].max() > H, "boxes that tell x from y"
    assert isinstance(boxes, TensorBBox) and boxes.abs().max() <= 1 and (boxes[~real] == 0).all() and (labels[~real] == 0).all()
    assert torch.allclose((boxes[real] + 1) * torch.tensor([W, H, W, H])/2, d['boxes'][real], atol=1e-4)
    model.valid_loss = False
    with torch.no_grad(): out = model(x, bx, lb)
    assert out['losses'] == {} and math.isnan(detection_loss(out).item())
    assert not any(m.training for m in model.modules())

def test_activation_decodes_a_known_detection():
    "A detection in pixels of a 48x64 (h x w) image, in fastai's [-1, 1]: x over the width, y over the height"
    d = {'boxes': torch.tensor([[[8., 6., 56., 42.], [0., 0., 0., 0.]]]), 'scores': torch.tensor([[0.9, 0.]]),
         'labels': torch.tensor([[2, 0]])}
    pred = {'losses': {}, 'detections': d, 'size': torch.tensor([[H, W]], dtype=torch.float32)}
    boxes,labels,scores = DetectionLoss().activation(pred)
    assert torch.allclose(boxes[0, 0], torch.tensor([8*2/W - 1, 6*2/H - 1, 56*2/W - 1, 42*2/H - 1]))
    assert (boxes[0, 1] == 0).all() and labels.tolist() == [[2, 0]] and torch.equal(scores, d['scores'])
    back = fastai_to_targets(boxes, labels, (H, W))[0]  # and back to the pixels torchvision and the mAP use
    assert torch.allclose(back['boxes'], d['boxes'][0, :1], atol=1e-4) and back['labels'].tolist() == [2]

def test_adapter_reports_height_then_width():
    "`DetectionAdapter`'s `size` is (h, w) of the batch: what `activation` divides y and x by"
    torch.manual_seed(0)
    model = DetectionAdapter(small_detector(4, (H, W), fpn_channels=64)).eval()
    with torch.no_grad(): out = model(torch.randn(2, 3, H, W))
    assert out['size'].tolist() == [[H, W], [H, W]]

def fake_learn(x, bx, lb, dets):
    return SimpleNamespace(xb=(x, bx, lb), yb=(bx, lb), pred={'losses': {}, 'detections': padded_detections(dets, 8)})

def test_map_perfect_and_shifted(batch):
    x,bx,lb,_,_ = batch
    ts = fastai_to_targets(bx, lb, (H, W))
    perfect = [{'boxes': t['boxes'], 'scores': torch.ones(len(t['labels'])), 'labels': t['labels']} for t in ts]
    shifted = [{**d, 'boxes': d['boxes'] + torch.tensor([6., 0., 6., 0.])} for d in perfect]
    wrong = [{**d, 'labels': d['labels'] % 3 + 1} for d in perfect]
    res = {}
    for key in ('map', 'map_50'):
        m = DetectionMAP(key)
        for name,dets in (('perfect', perfect), ('shifted', shifted), ('wrong', wrong)):
            m.reset(); m.accumulate(fake_learn(x, bx, lb, dets)); res[key, name] = m.value
    assert res['map', 'perfect'] == res['map_50', 'perfect'] == 1.0
    assert res['map', 'shifted'] < res['map_50', 'shifted'] <= 1.0 and res['map', 'shifted'] < 0.8
    assert res['map', 'wrong'] == 0.0

def test_map_of_another_evaluates_once(batch, monkeypatch):
    "detection_learner's mAP columns: the second reports its number of the first's one COCO evaluation an epoch"
    from torchmetrics.detection import MeanAveragePrecision
    x,bx,lb,_,_ = batch
    ts = fastai_to_targets(bx, lb, (H, W))
    shifted = [{'boxes': t['boxes'] + torch.tensor([6., 0., 6., 0.]), 'scores': torch.ones(len(t['labels'])), 'labels': t['labels']} for t in ts]
    learn = fake_learn(x, bx, lb, shifted)
    alone = {}
    for key in ('map', 'map_50'):
        m = DetectionMAP(key); m.accumulate(learn); alone[key] = m.value
    evaluated,compute = [],MeanAveragePrecision.compute
    monkeypatch.setattr(MeanAveragePrecision, 'compute', lambda self: evaluated.append(1) or compute(self))  # before the metrics: torchmetrics wraps it
    m = DetectionMAP(); m50 = DetectionMAP('map_50', of=m)
    learn.metrics = [m, m50]
    for epoch in range(2):
        for k in (m, m50): k.reset()
        assert m50.value is None
        for k in (m, m50): k.accumulate(learn)
        assert (m50.value, m.value, m50.value) == (alone['map_50'], alone['map'], alone['map_50'])
    assert len(evaluated) == 2 # once an epoch
    learn.metrics = [m50]
    with pytest.raises(ValueError, match="not among the learner's metrics"): m50.accumulate(learn)
    with pytest.raises(TypeError, match="reports another DetectionMAP's evaluation; got a str"): DetectionMAP('map_50', of='map')

def test_map_accumulates_batches(batch):
    "Two batches, one predicted perfectly and one not at all: half the objects found"
    x,bx,lb,_,_ = batch
    ts = fastai_to_targets(bx, lb, (H, W))
    perfect = [{'boxes': t['boxes'], 'scores': torch.ones(len(t['labels'])), 'labels': t['labels']} for t in ts]
    empty = [{'boxes': torch.zeros(0, 4), 'scores': torch.zeros(0), 'labels': torch.zeros(0, dtype=torch.long)} for _ in ts]
    m = DetectionMAP('mar_100')
    m.accumulate(fake_learn(x, bx, lb, perfect)); m.accumulate(fake_learn(x, bx, lb, empty))
    assert m.value == pytest.approx(0.5) and m.name == 'mar_100'


def test_map_backends_agree(batch):
    "faster_coco_eval (DetectionMAP's backend where installed) gives pycocotools' numbers: noisy boxes, scores and labels over many images"
    from dali_fastai.detection import coco_backend
    pytest.importorskip('faster_coco_eval'); pytest.importorskip('pycocotools')
    x,bx,lb,_,_ = batch
    g = torch.Generator().manual_seed(0)
    learns = []
    for _ in range(6):
        ts = fastai_to_targets(bx, lb, (H, W))
        dets = []
        for t in ts:
            b = t['boxes'].repeat(3, 1) + 4*torch.randn(3*len(t['boxes']), 4, generator=g) # near misses and hits
            l = t['labels'].repeat(3); l[torch.rand(len(l), generator=g) < 0.2] = 1 # some wrong classes
            dets.append({'boxes': b, 'scores': torch.rand(len(l), generator=g), 'labels': l})
        learns.append(fake_learn(x, bx, lb, dets))
    def numbers(**kw):
        m = DetectionMAP(**kw)
        for learn in learns: m.accumulate(learn)
        return m.mean_ap._coco_backend.backend,m.numbers() # the backend torchmetrics runs
    (default,ours),(_,ref) = numbers(),numbers(backend='pycocotools')
    assert default == coco_backend() == 'faster_coco_eval'
    for k in ('map', 'map_50', 'map_75', 'mar_1', 'mar_10', 'mar_100'):
        assert 0.05 < ref[k] < 0.95 and ours[k].item() == pytest.approx(ref[k].item(), abs=1e-6), k


@pytest.fixture(scope='module')
def scene_learner(tmp_path_factory):
    "An untrained detector's `Learner` on DALI loaders over a few embedded scenes (every box scored: its predictions are drawn)"
    from fastai.vision.all import Resize
    from dali_fastai.data import DaliDataLoaders
    from dali_fastai.detection import detection_learner
    from dali_fastai.scenes import fashion_scenes
    path = fashion_scenes(tmp_path_factory.mktemp('scenes')/'s', n_train=40, n_valid=4, size=64, progress=False)
    dls = DaliDataLoaders.from_coco(path, images='JPEGImages', bs=2, item_tfms=Resize(64), device='cpu', seed=0)
    torch.manual_seed(0)
    return detection_learner(dls, small_detector(len(dls.vocab), 64, fpn_channels=64, score_thresh=0.0, detections_per_img=3))

def test_detection_learner_evaluates_map_once(scene_learner):
    "detection_learner's default columns: COCO's mAP and mAP at IoU 0.5, the second of the first's evaluation"
    metrics = scene_learner.metrics
    assert [k.name for k in metrics] == ['map', 'map_50'] and metrics[1].of is metrics[0]

def test_show_results_names_the_boxes(scene_learner):
    "Targets and predictions are drawn with their class names; the mAP metrics do not warn (nothing to compute)"
    learn = scene_learner
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        with learn.no_bar(): ctxs = learn.show_results(max_n=2, shuffle=False)
    assert [str(x.message) for x in w if 'compute' in str(x.message)] == []
    names = [[t.get_text() for t in ax.texts] for ax in ctxs]
    vocab = set(learn.dls.vocab[1:])
    assert len(ctxs) == 4 and names[0] and names[2] and set(names[0] + names[2]) <= vocab  # the targets, named
    assert names[1] and names[3] and set(names[1] + names[3]) <= vocab  # the predictions, named
    xb,boxes,labels = learn.dls.valid.one_batch()
    assert names[0] == [learn.dls.vocab[int(l)] for l in labels[0] if l != 0]  # the first image's objects, in order
    plt.close('all')

def test_predict_does_not_warn(scene_learner):
    "predict on a file: boxes with class names, and no warning from the mAP metrics (no batch reached them)"
    learn = scene_learner
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        with learn.no_bar(): full,boxes,_ = learn.predict(learn.dls.valid.items.files[0])
    assert [str(x.message) for x in w if 'compute' in str(x.message)] == []
    assert isinstance(boxes, TensorBBox) and set(full[1].lbl) <= set(learn.dls.vocab)


def test_detection_map_without_torchmetrics_says_which_extra_installs_it(monkeypatch):
    "torchmetrics is the `detection` extra's: without it DetectionMAP says so when made, not at the first validation"
    monkeypatch.setitem(sys.modules, 'torchmetrics.detection', None)
    with pytest.raises(ImportError, match=r"DetectionMAP needs the module 'torchmetrics.detection'.*pip install 'dali-fastai\[detection\]'"):
        DetectionMAP()


@pytest.mark.parametrize('arch,size', [('retinanet', (64, 96)), ('fcos', (48, 64))])
def test_batched_transform_trains_and_predicts_as_torchvision_s(arch, size):
    "The same losses and detections as torchvision's own transform, both when it stacks the batch as it is (64 x 96) and when torchvision's steps must resize and pad it (48 x 64 is padded to 64)"
    from torchvision.models.detection.transform import GeneralizedRCNNTransform
    torch.manual_seed(0)
    ours = small_detector(4, size, arch, fpn_channels=32, score_thresh=0.)  # every image has detections to compare
    theirs = small_detector(4, size, arch, fpn_channels=32, score_thresh=0.); theirs.load_state_dict(ours.state_dict())
    t = ours.transform
    theirs.transform = GeneralizedRCNNTransform(t.min_size, t.max_size, t.image_mean, t.image_std)
    assert type(ours.transform) is BatchedTransform and ours.transform.unchanged(list(torch.zeros(2, 3, *size))) == (size[0] % 32 == 0)
    h,w = size
    xs = list(torch.randn(2, 3, h, w))
    targets = [{'boxes': torch.tensor([[4., 6., 30., 40.]]), 'labels': torch.tensor([2])},
               {'boxes': torch.tensor([[10., 2., 20., 12.], [0., 0., 40., 30.]]), 'labels': torch.tensor([1, 3])}]
    a,b = ours(xs, targets),theirs(xs, targets)
    for k in a: assert torch.allclose(a[k], b[k], atol=1e-6), (k, a[k], b[k])
    ours.eval(); theirs.eval()
    with torch.no_grad(): da,db = ours(xs),theirs(xs)
    for x,y in zip(da, db):
        assert len(x['boxes']) > 0
        for k in x: assert torch.allclose(x[k], y[k], atol=1e-5), k


def torchvision_twin(model):
    "torchvision's own FCOS or RetinaNet made of `model`'s modules: its transform, box check, matching and losses"
    from torchvision.models.detection import FCOS, RetinaNet
    t = model.transform
    cls = FCOS if isinstance(model, FCOS) else RetinaNet
    return cls(model.backbone, 5, min_size=t.min_size, max_size=t.max_size, image_mean=t.image_mean, image_std=t.image_std,
               anchor_generator=model.anchor_generator, head=model.head)

def step(model, xs, targets):
    "One training step's losses and the head's gradients"
    model.zero_grad()
    losses = model(xs, targets)
    sum(losses.values()).backward()
    return {k: v.detach() for k,v in losses.items()},{n: p.grad.clone() for n,p in model.head.named_parameters()}

def scene(n_boxes, size=128, seed=0, small=False, large=False):
    """Boxes for each image (`n_boxes` each): 4 to 104 pixels; `small`: 2 to 10, whose best anchors' IoUs are below the
    thresholds; `large`: 3 to 153, clipped to the image, for every pyramid level's range of sizes"""
    g = torch.Generator().manual_seed(seed)
    res = []
    for n in n_boxes:
        xy = torch.rand(n, 2, generator=g) * (size - 12)
        wh = 2 + torch.rand(n, 2, generator=g) * 8 if small else 3 + torch.rand(n, 2, generator=g) * 150 if large else 4 + torch.rand(n, 2, generator=g) * 100
        res.append({'boxes': torch.cat([xy, (xy + wh).clamp(max=size)], -1), 'labels': torch.randint(1, 5, (n,), generator=g)})
    return res

@pytest.mark.parametrize('arch', ['fcos', 'retinanet'])
@pytest.mark.parametrize('case', ['mixed', 'small boxes', 'large boxes', 'no boxes'])
def test_batched_step_is_torchvision_s(arch, case):
    "A training step of BatchedFCOS/BatchedRetinaNet: torchvision's losses and gradients, images without boxes included"
    torch.manual_seed(3)
    model = small_detector(5, 128, arch, fpn_channels=32)
    assert type(model) is {'fcos': BatchedFCOS, 'retinanet': BatchedRetinaNet}[arch]
    twin = torchvision_twin(model)
    targets = scene({'mixed': [5, 3, 0, 1, 6], 'small boxes': [3, 2, 0, 4, 1], 'large boxes': [6, 0, 2, 4, 3], 'no boxes': [0]*5}[case],
                    small=case == 'small boxes', large=case == 'large boxes')
    xs = list(torch.randn(5, 3, 128, 128))
    (l_ours,g_ours),(l_theirs,g_theirs) = step(model, xs, targets),step(twin, xs, targets)
    assert l_ours.keys() == l_theirs.keys()
    for k in l_theirs: assert torch.allclose(l_ours[k], l_theirs[k], rtol=1e-5, atol=1e-6), (k, l_ours[k], l_theirs[k])
    for k in g_theirs: assert torch.allclose(g_ours[k], g_theirs[k], rtol=1e-4, atol=1e-6), k
    if case == 'no boxes': assert all(v == 0 for k,v in l_ours.items() if k != 'classification')
    else: assert all(v > 0 for v in l_ours.values())

@pytest.mark.parametrize('small', [False, True])
def test_retinanet_match_is_torchvision_s(small):
    """BatchedRetinaNet.match gives each anchor the box torchvision's Matcher gives it, image by image: -2 between the thresholds, and
    boxes too small for any anchor's IoU to reach 0.4 still get their best anchors (the low-quality rule)"""
    from torchvision.ops import box_iou
    model = small_detector(5, 128, 'retinanet', fpn_channels=32)
    targets = scene([5, 3, 0, 1, 6], small=small)
    boxes = torch.nn.utils.rnn.pad_sequence([t['boxes'] for t in targets], batch_first=True)
    real = torch.nn.utils.rnn.pad_sequence([torch.ones(len(t['boxes']), dtype=torch.bool) for t in targets], batch_first=True)
    images,_ = model.transform(list(torch.randn(5, 3, 128, 128)))
    anchors = torch.stack(model.anchor_generator(images, list(model.backbone(images.tensors).values())))
    ours = model.match(boxes, real, anchors)
    for i,t in enumerate(targets):
        theirs = model.proposal_matcher(box_iou(t['boxes'], anchors[i])) if len(t['boxes']) else torch.full_like(ours[i], -1)
        assert torch.equal(ours[i], theirs), i
    if small:
        assert (torch.vmap(box_iou)(boxes, anchors).amax((1, 2)) < 0.4).all()
        for i,t in enumerate(targets): assert set(ours[i][ours[i] >= 0].tolist()) == set(range(len(t['boxes'])))
    else: assert (ours == -2).sum() > 20 and (ours >= 0).sum() > 20

def test_giou_loss_is_torchvision_s():
    from torchvision.ops import generalized_box_iou_loss
    from dali_fastai.detectors import _giou_loss
    torch.manual_seed(4)
    a,b = torch.rand(2, 500, 4) * 60
    a[:, 2:] += a[:, :2] + 1; b[:, 2:] += b[:, :2] + 1
    assert torch.allclose(_giou_loss(a, b), generalized_box_iou_loss(a, b), atol=1e-6)

@pytest.mark.parametrize('arch', ['fcos', 'retinanet'])
def test_a_box_without_width_is_named(arch):
    model = small_detector(5, 128, arch, fpn_channels=32)
    targets = scene([2, 1, 3])
    targets[2]['boxes'][1, 3] = targets[2]['boxes'][1, 1] # no height
    with pytest.raises(ValueError, match=r'target 2 has a box with no width or height'): model(list(torch.randn(3, 3, 128, 128)), targets)

@pytest.mark.parametrize('arch', ['fcos', 'retinanet'])
@pytest.mark.parametrize('size', [128, 96])
def test_padded_losses_are_the_list_step_s(arch, size):
    """`padded_losses` (what DetectionAdapter calls with fastai's padded batch) gives the losses of the model's list step on the
    same targets: padded as they are when the images need no resizing (96 px for a 128 px model: torchvision's own steps)"""
    torch.manual_seed(5)
    model = small_detector(5, 128, arch, fpn_channels=32)
    targets = scene([5, 3, 0, 1, 6])
    x = torch.randn(5, 3, size, size)
    boxes,labels,real = padded_targets(targets)
    ours,theirs = model.padded_losses(x, boxes, labels, real),model(list(x), targets)
    assert ours.keys() == theirs.keys()
    for k in theirs: assert torch.allclose(ours[k], theirs[k], rtol=1e-5, atol=1e-6), k

def test_unpadded_targets_undo_padded_targets():
    targets = scene([5, 3, 0, 1, 6])
    back = unpadded_targets(*padded_targets(targets))
    assert [len(t['labels']) for t in back] == [5, 3, 0, 1, 6]
    for a,b in zip(back, targets): assert torch.equal(a['boxes'], b['boxes']) and torch.equal(a['labels'], b['labels'])

def test_fastai_to_padded_is_fastai_to_targets_padded(batch):
    "fastai's batch straight to padded pixels (no read of the device) holds what fastai_to_targets gives, padded as padded_targets pads it"
    _,bx,lb,_,_ = batch
    ours,theirs = fastai_to_padded(bx, lb, (H, W)),padded_targets(fastai_to_targets(bx, lb, (H, W)))
    for a,b in zip(ours, theirs): assert torch.equal(a, b)
    b,l,r = fastai_to_padded(bx[:, :0], lb[:, :0], (H, W))  # no image has a box: one padding row, as padded_targets keeps
    assert b.shape == (3, 1, 4) and not r.any() and (l == 0).all()

@needs_gpu('the box check on the GPU')
def test_box_check_on_the_gpu_waits_for_nothing_and_raises_later():
    "On a GPU the check reads nothing while the step runs: the empty box is left out of the step, and named at the next check"
    check = BoxCheck()
    boxes = torch.tensor([[[0., 0., 10., 10.], [5., 5., 5., 9.]]], device='cuda')
    real = torch.ones(1, 2, dtype=torch.bool, device='cuda')
    torch.cuda.set_sync_debug_mode('error')
    try: kept = check(boxes, real)
    finally: torch.cuda.set_sync_debug_mode(0)
    assert kept.tolist() == [[True, False]]
    with pytest.raises(ValueError, match=r'target 0 of an earlier training batch has a box with no width or height, \[5.0, 5.0, 5.0, 9.0\]'):
        check.check()
    assert check(boxes[:, :1], real[:, :1]).tolist() == [[True]]
    check.check()  # a batch of good boxes: nothing to say

@needs_gpu('a detector training step on the GPU')
@pytest.mark.parametrize('arch', ['fcos', 'retinanet'])
def test_a_detector_step_on_the_gpu_makes_no_host_sync(batch, arch):
    "DetectionAdapter's training step (fastai's padded batch in, backward) reads nothing from the device"
    _,bx,lb,_,_ = batch  # on images of a size the detector takes as they are (sides divisible by 32): no per-image steps
    model = DetectionAdapter(small_detector(4, (64, 96), arch=arch, fpn_channels=64)).cuda().train()
    x,bx,lb = torch.randn(3, 3, 64, 96, device='cuda'),bx.cuda(),lb.cuda()
    detection_loss(model(x, bx, lb)).backward()  # the first step: anchors cached, pinned memory allocated
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode('error')
    try: detection_loss(model(x, bx, lb)).backward()
    finally: torch.cuda.set_sync_debug_mode(0)
    model.eval()  # the box check's verdicts read: all good

@needs_gpu('a detector captured as a CUDA graph')
@pytest.mark.parametrize('arch', ['fcos', 'retinanet'])
def test_a_detector_step_replays_as_a_cuda_graph(batch, arch):
    """FastStep(graph=True)'s capture of a detector: the replayed step gives the eager step's losses and gradients (also
    after a validation batch of another size, whose anchors must not free the graph's), a batch with more box rows gets a
    graph of its own, and an empty box in a replayed batch is named at the next train()/eval()"""
    from dali_fastai.capture import GraphCapture
    _,bx,lb,_,_ = batch
    torch.manual_seed(0)
    model = DetectionAdapter(small_detector(4, (64, 96), arch=arch, fpn_channels=64)).cuda().train()
    x,bx,lb = torch.randn(3, 3, 64, 96, device='cuda'),_pad8(bx).cuda(),_pad8(lb).cuda()
    def step():
        model.zero_grad()
        loss = detection_loss(model(x, bx, lb)); loss.backward()
        return loss.detach(),{k: p.grad.clone() for k,p in model.named_parameters() if p.grad is not None}
    eager = step()
    warned = []
    capture = GraphCapture(SimpleNamespace(model=model), warned.append, whole=False); capture.install()  # the model's capture (its loss is outside it)
    def same(a, b): # cuDNN's kernels under capture may differ: equal to float rounding, each gradient as a whole
        assert torch.allclose(a[0], b[0], rtol=1e-4), (a[0], b[0])
        for k in b[1]: assert (a[1][k] - b[1][k]).norm() <= 1e-3 * b[1][k].norm() + 1e-6, k
    step(); same(step(), eager)  # captured, then replayed
    assert not warned and len(capture.graphs) == 1
    kept = dict(model.model.anchor_generator._kept)  # the anchors the graph reads
    model.eval()
    with torch.no_grad(): model(x[:2])  # a validation batch of another size
    assert all(model.model.anchor_generator._kept[k] is v for k,v in kept.items())
    model.train()
    junk = [torch.full((n,), 1e6, device='cuda') for n in (128, 512, 2048, 8192) for _ in range(64)]  # memory freed meanwhile is reused
    same(step(), eager)
    del junk
    assert len(capture.graphs) == 1
    bx,lb = torch.cat([bx, bx], 1),torch.cat([lb, lb], 1)
    step(); assert len(capture.graphs) == 2
    bx[1, 0] = torch.tensor([0.5, 0.5, 0.5, 0.9], device='cuda')  # a box with no width, in a replayed batch
    step()
    with pytest.raises(ValueError, match='replayed from a CUDA graph'): model.eval()
    capture.release()

def test_retinanet_coder_weights_follow_the_model_and_stay_out_of_checkpoints():
    "BatchedRetinaNet keeps its box coder's weights as a buffer: moved with the model, not saved, pickled without trouble"
    import pickle
    model = small_detector(5, 128, 'retinanet', fpn_channels=32)
    assert model.coder_weights.tolist() == list(model.head.regression_head.box_coder.weights)
    assert 'coder_weights' not in model.state_dict()
    assert pickle.loads(pickle.dumps(model)).coder_weights.tolist() == model.coder_weights.tolist()

def test_cached_anchors_follow_the_batch():
    "CachedAnchors gives the anchors torchvision's generator makes, again for the same sizes, anew for another batch or size"
    from torchvision.models.detection.anchor_utils import AnchorGenerator
    from dali_fastai.detectors import CachedAnchors
    model = small_detector(5, (64, 96), fpn_channels=32)
    assert type(model.anchor_generator) is CachedAnchors
    plain = AnchorGenerator(((8,), (16,), (32,), (64,), (128,)), ((1.0,),)*5)
    for n,(h,w) in [(3, (64, 96)), (3, (64, 96)), (2, (64, 96)), (2, (64, 128))]:
        images,_ = model.transform(list(torch.randn(n, 3, h, w)))
        feats = list(model.backbone(images.tensors).values())
        got,want = model.anchor_generator(images, feats),plain(images, feats)
        assert len(got) == n and all(torch.equal(a, b) for a,b in zip(got, want)), (n, h, w)

def test_cached_anchors_are_never_dropped():
    "Anchors kept for one batch size stay kept (a captured graph reads them) after more sizes than CachedAnchors keeps; those are made anew"
    model = small_detector(5, (64, 96), fpn_channels=32)
    gen = model.anchor_generator
    def anchors(n):
        images,_ = model.transform(list(torch.randn(n, 3, 64, 96)))
        return images,list(model.backbone(images.tensors).values())
    first = gen(*anchors(1))
    for n in range(2, gen.max_kept + 3): gen(*anchors(n))
    assert len(gen._kept) == gen.max_kept
    assert all(a is b for a,b in zip(gen(*anchors(1)), first))
    images,feats = anchors(gen.max_kept + 2)  # a size past the kept ones: the right anchors, made each time
    got,again = gen(images, feats),gen(images, feats)
    assert all(torch.equal(a, b) and a is not b for a,b in zip(got, again))


def test_cached_cell_anchors_are_kept_per_dtype():
    "Each dtype's cell anchors are made from the first ones and kept: a bf16 batch between two float32 ones frees nothing and rounds nothing"
    import pickle
    from torchvision.models.detection.anchor_utils import AnchorGenerator
    gen = small_detector(5, (64, 96), 'retinanet', fpn_channels=32).anchor_generator
    plain = AnchorGenerator(gen.sizes, gen.aspect_ratios)
    cpu = torch.device('cpu')
    gen.set_cell_anchors(torch.float32, cpu); before = gen.cell_anchors
    gen.set_cell_anchors(torch.bfloat16, cpu); gen.set_cell_anchors(torch.float32, cpu)
    assert all(a is b for a,b in zip(gen.cell_anchors, before)) # the same memory: a graph's copy is not freed
    assert all(torch.equal(a, b) for a,b in zip(gen.cell_anchors, plain.cell_anchors)) # not rounded through bf16
    back = pickle.loads(pickle.dumps(gen))
    assert all(a.dtype == torch.float32 and torch.equal(a, b) for a,b in zip(back.cell_anchors, plain.cell_anchors))


# validation: one forward of the backbone and head for the losses and the detections (`padded_eval`, `batch_detections`)

@contextmanager
def backbone_calls(model):
    "How many times `model`'s backbone runs inside the block"
    calls = []
    hook = model.backbone.register_forward_hook(lambda *_: calls.append(1))
    try: yield calls
    finally: hook.remove()

def same_detections(ours, theirs):
    "Each image's padded detections are torchvision's: its scores in order, its boxes and labels (in any order among equal scores)"
    for i,t in enumerate(theirs):
        n = len(t['scores'])
        assert int((ours['scores'][i] > 0).sum()) == n, (i, n)
        assert torch.allclose(ours['scores'][i, :n], t['scores'], atol=1e-6), i
        for s in t['scores'].unique():
            m = (t['scores'] == s).nonzero()[:, 0]  # rows of one score
            rows = lambda b,l: sorted(zip(l[m].tolist(), b[m].round(decimals=2).tolist(), b[m].tolist()))
            a,b = rows(ours['boxes'][i, :n], ours['labels'][i, :n]),rows(t['boxes'], t['labels'])
            assert [r[0] for r in a] == [r[0] for r in b], i
            assert torch.allclose(torch.tensor([r[2] for r in a]), torch.tensor([r[2] for r in b]), atol=1e-4), i

EVAL_CASES = {'many': dict(score_thresh=0.), 'cut at 3': dict(score_thresh=0., detections_per_img=3),
              'few candidates': dict(score_thresh=0., topk_candidates=5), 'none': dict(score_thresh=1.)}

@pytest.mark.parametrize('arch', ['fcos', 'retinanet'])
@pytest.mark.parametrize('case', list(EVAL_CASES))
def test_padded_eval_is_the_losses_and_torchvision_s_detections(arch, case):
    """One backbone forward gives `padded_losses`' losses (normalization layers in evaluation mode) and torchvision's
    detections image by image: many candidates, detections_per_img cutting, few candidates a level, none above the threshold"""
    from dali_fastai.postprocess import _loss_mode
    torch.manual_seed(0)
    model = small_detector(5, (64, 96), arch, fpn_channels=32, **EVAL_CASES[case]).eval()
    x,targets = torch.randn(6, 3, 64, 96),padded_targets(scene([3, 0, 2, 1, 4, 2], size=64))
    with torch.no_grad():
        with backbone_calls(model) as calls: losses,dets = model.padded_eval(x, *targets)
        with _loss_mode(model): want = model.padded_losses(x, *targets)
        theirs = model(list(x))
    assert len(calls) == 1 and not model.training
    assert losses.keys() == want.keys()
    for k in want: assert torch.allclose(losses[k], want[k], rtol=1e-5, atol=1e-6), k
    assert {k: v.shape for k,v in dets.items()} == {'boxes': (6, model.detections_per_img, 4), 'labels': (6, model.detections_per_img),
                                                    'scores': (6, model.detections_per_img)}
    same_detections(dets, theirs)
    counts = [len(t['scores']) for t in theirs]
    assert counts == {'many': [model.detections_per_img]*6, 'cut at 3': [3]*6, 'few candidates': counts, 'none': [0]*6}[case]
    if case == 'few candidates': assert 0 < min(counts) and max(counts) <= 5*5  # 5 levels, 5 candidates each

@pytest.mark.parametrize('arch', ['fcos', 'retinanet'])
def test_batch_detections_are_torchvision_s_of_the_same_outputs(arch):
    "Scores drawn so that many pass: an image with none above the threshold, levels cut to topk_candidates, images cut to detections_per_img"
    from torchvision.models.detection.image_list import ImageList
    from dali_fastai.postprocess import batch_detections
    torch.manual_seed(1)
    model = small_detector(5, (64, 96), arch, fpn_channels=32, score_thresh=0.3, topk_candidates=40, detections_per_img=25).eval()
    with torch.no_grad(): head_outputs,anchors,levels = model._outputs(ImageList(torch.randn(5, 3, 64, 96), [(64, 96)]*5))
    head_outputs['cls_logits'] = torch.randn_like(head_outputs['cls_logits']) * 2
    head_outputs['cls_logits'][2] = -10.  # no score above the threshold
    head_outputs['cls_logits'][3, :50] = float('nan')  # a diverged image: torchvision drops NaN before its top-k
    per_level = [anchors.shape[1] // sum(levels) * m for m in levels]
    split = {k: list(v.split(per_level, 1)) for k,v in head_outputs.items()}
    theirs = model.postprocess_detections(split, [list(a.split(per_level)) for a in anchors], [(64, 96)]*5)
    same_detections(batch_detections(model, head_outputs, anchors, levels, (64, 96)), theirs)
    assert [len(t['scores']) for t in theirs] == [25, 25, 0, 25, 25]

def test_padded_eval_takes_the_targets_whole(batch):
    "Boxes without their labels and real rows: an error naming what came, not one deep in the box check"
    _,bx,lb,_,_ = batch
    model = small_detector(4, (64, 96), fpn_channels=32).eval()
    boxes,labels,real = fastai_to_padded(bx, lb, (64, 96))
    with pytest.raises(ValueError, match=r"takes the padded targets whole .* got only boxes, labels"):
        model.padded_eval(torch.randn(3, 3, 64, 96), boxes, labels)
    from dali_fastai.postprocess import batch_detections
    with pytest.raises(TypeError, match="batch_detections needs a BatchedFCOS or BatchedRetinaNet .* got a Linear"):
        batch_detections(torch.nn.Linear(1, 1), {}, torch.zeros(1, 1, 4), [1], (64, 96))

def test_boxes_of_other_images_or_classes_never_suppress_each_other():
    "One box, copied to each image and each class: NMS over the batch keeps every copy"
    from dali_fastai.postprocess import _nms
    boxes = torch.tensor([[0., 0., 96., 64.]]).repeat(6, 1)
    img,labels = torch.tensor([0, 0, 1, 1, 2, 2]),torch.tensor([1, 2, 1, 2, 1, 2])
    assert sorted(_nms(boxes, torch.rand(6), labels, img, (64, 96), 0.5, [2, 2, 2]).tolist()) == list(range(6))
    assert len(_nms(boxes, torch.rand(6), labels*0, img*0, (64, 96), 0.5, [6])) == 1  # the same image and class: one kept

def test_nms_groups_images_to_bound_its_mask(monkeypatch):
    "Candidates of many images go through NMS in groups of at most NMS_ROWS (an image with more alone), keeping what one call keeps"
    import dali_fastai.postprocess as D
    assert D._groups([3, 2, 4, 9, 1], 5) == [(0, 5), (5, 9), (9, 18), (18, 19)]
    assert D._groups([0, 0], 5) == [] and D._groups([6], 5) == [(0, 6)]
    torch.manual_seed(0)
    counts = [7, 0, 12, 5, 9]
    img = torch.repeat_interleave(torch.arange(5), torch.tensor(counts))
    xy = torch.rand(len(img), 2) * 60; boxes = torch.cat([xy, xy + 10 + torch.rand(len(img), 2) * 20], 1).clamp(max=64)
    labels,scores = torch.randint(0, 3, (len(img),)),torch.rand(len(img))
    one = D._nms(boxes, scores, labels, img, (64, 96), 0.5, counts)  # one call: fewer than NMS_ROWS
    monkeypatch.setattr(D, 'NMS_ROWS', 10)
    grouped = D._nms(boxes, scores, labels, img, (64, 96), 0.5, counts)
    assert sorted(grouped.tolist()) == sorted(one.tolist()) and len(one) < len(img)
    for i in range(5): assert grouped[img[grouped] == i].tolist() == one[img[one] == i].tolist() # each image's by decreasing score

@pytest.mark.parametrize('arch', ['fcos', 'retinanet'])
def test_adapter_validates_with_one_backbone_forward(batch, arch):
    """DetectionAdapter in validation: one backbone forward for the losses and the detections (two before `padded_eval`),
    the detections torchvision's evaluation's and the losses its training step's with normalization layers in evaluation mode"""
    from dali_fastai.postprocess import _loss_mode
    _,bx,lb,_,_ = batch
    torch.manual_seed(0)
    model = DetectionAdapter(small_detector(4, (64, 96), arch, fpn_channels=32, score_thresh=0.)).eval()
    x = torch.randn(3, 3, 64, 96)
    with torch.no_grad():
        with backbone_calls(model.model) as calls: out = model(x, _pad8(bx), _pad8(lb))
        assert len(calls) == 1
        with _loss_mode(model.model): want = model._losses(x, bx, lb)
        theirs = model.model(list(x))
        model.valid_loss = False
        with backbone_calls(model.model) as calls: no_loss = model(x, bx, lb)
    assert len(calls) == 1 and no_loss['losses'] == {}
    for k in want: assert out['losses'][k].shape == (1,) and torch.allclose(out['losses'][k], want[k].reshape(1), rtol=1e-5, atol=1e-6), k
    same_detections(out['detections'], theirs); same_detections(no_loss['detections'], theirs)

@pytest.mark.parametrize('kind', ['resized batch', 'torchvision detector'])
def test_adapter_validation_falls_back_to_torchvision_s_steps(batch, kind):
    """A batch the detector's transform resizes (96 px for a 128 px detector), or a detector without `padded_eval`: the
    training forward for the losses, then torchvision's evaluation forward"""
    from dali_fastai.postprocess import _loss_mode
    _,bx,lb,_,_ = batch
    torch.manual_seed(0)
    model = small_detector(5, 128, 'fcos', fpn_channels=32, score_thresh=0.)
    if kind == 'torchvision detector': model = torchvision_twin(model); model.score_thresh = 0.
    adapter,x = DetectionAdapter(model).eval(),torch.randn(3, 3, 96, 96)
    with torch.no_grad():
        with backbone_calls(model) as calls: out = adapter(x, bx, lb)
        with _loss_mode(model): want = adapter._losses(x, bx, lb)
        theirs = model(list(x))
    assert len(calls) == 2 and hasattr(model, 'padded_eval') == (kind == 'resized batch')
    for k in want: assert torch.allclose(out['losses'][k], want[k].reshape(1), rtol=1e-5, atol=1e-6), k
    same_detections(out['detections'], theirs)
    assert not any(m.training for m in adapter.modules())

@needs_gpu('the batched validation step on the GPU')
@pytest.mark.parametrize('arch', ['fcos', 'retinanet'])
def test_padded_eval_on_the_gpu_is_torchvision_s(arch):
    "On the GPU too, for a batch of 64: torchvision's detections image by image, from one forward"
    torch.manual_seed(0)
    model = small_detector(11, 128, arch, fpn_channels=64, score_thresh=0.05 if arch == 'fcos' else 0.01).cuda().eval()
    x = torch.randn(64, 3, 128, 128, device='cuda')
    targets = padded_targets([{k: v.cuda() for k,v in t.items()} for t in scene([3, 0, 2, 1]*16)])
    with torch.no_grad():
        with backbone_calls(model) as calls: losses,dets = model.padded_eval(x, *targets)
        theirs = model(list(x))
    assert len(calls) == 1 and sum(len(t['scores']) for t in theirs) > 64*10
    same_detections({k: v.cpu() for k,v in dets.items()}, [{k: v.cpu() for k,v in t.items()} for t in theirs])


# issue 41: promises no test held, each against torchvision's (or fastai's) behaviour on the same input

def test_nms_keeps_the_images_of_a_tall_batch_apart():
    "Height above width: the same boxes in two images (and overlapping ones within each) keep what torchvision's batched_nms keeps image by image"
    from torchvision.ops import batched_nms
    from dali_fastai.postprocess import _nms
    h,w = 128, 16
    g = torch.Generator().manual_seed(0)
    one = torch.tensor([[0., 0., 16., 128.], [0., 4., 16., 120.], [2., 0., 14., 60.], [0., 70., 16., 128.]])  # tall boxes, some overlapping
    boxes = torch.cat([one, one])
    img,labels = torch.tensor([0]*4 + [1]*4),torch.tensor([1, 1, 1, 2]*2)
    scores = torch.rand(8, generator=g)
    kept = _nms(boxes, scores, labels, img, (h, w), 0.5, [4, 4])
    for i in range(2):
        m = img == i
        theirs = batched_nms(boxes[m], scores[m], labels[m], 0.5) + 4*i
        assert kept[img[kept] == i].tolist() == theirs.tolist(), i
    assert len(kept) == 6  # the second box of each image is suppressed by the first, and nothing across the images


def test_fcos_leaves_an_anchor_point_on_a_box_edge_outside():
    "Boxes whose edges pass through anchor points (multiples of the stride): those anchors are outside, as torchvision's `> 0` has it"
    from types import SimpleNamespace
    from torchvision.models.detection import FCOS
    from dali_fastai.detectors import _image_list
    torch.manual_seed(0)
    model = small_detector(5, (64, 96), 'fcos', fpn_channels=32)
    targets = [{'boxes': torch.tensor([[16., 16., 32., 32.], [40., 8., 72., 40.], [0., 24., 24., 56.]]), 'labels': torch.tensor([1, 2, 3])},
               {'boxes': torch.tensor([[8., 8., 24., 40.]]), 'labels': torch.tensor([4])}]
    with torch.no_grad(): head_outputs,anchors,levels = model._outputs(_image_list(torch.randn(2, 3, 64, 96)))
    centres = (anchors[0, :, :2] + anchors[0, :, 2:]) / 2
    on_edge = [((centres[:, 0] == b[0]) | (centres[:, 0] == b[2]) | (centres[:, 1] == b[1]) | (centres[:, 1] == b[3])).sum()
               for t in targets for b in t['boxes']]
    assert all(n > 0 for n in on_edge)
    seen = []
    spy = SimpleNamespace(center_sampling_radius=model.center_sampling_radius,
                          head=SimpleNamespace(compute_loss=lambda targets, head_outputs, anchors, matched: seen.append(matched)))
    FCOS.compute_loss(spy, targets, head_outputs, list(anchors), levels)  # torchvision's assignment, image by image
    boxes,_,_ = padded_targets(targets)
    ours = model.match(boxes, anchors, levels)
    for i,theirs in enumerate(seen[0]): assert torch.equal(ours[i], theirs), i
    assert (ours >= 0).sum() > 5


@pytest.mark.parametrize('size', [(160, 192), (64, 96)], ids=['larger than max_size', 'at the size'])
def test_batched_transform_resizes_what_torchvision_resizes(size):
    "Images larger than the detector's max_size are resized with their boxes, as torchvision's transform does; images at its size go through as they are"
    from torchvision.models.detection.transform import GeneralizedRCNNTransform
    t = small_detector(5, (64, 96), fpn_channels=32).transform  # min_size 64, max_size 96
    theirs = GeneralizedRCNNTransform(t.min_size, t.max_size, t.image_mean, t.image_std, size_divisible=t.size_divisible)
    xs = list(torch.rand(2, 3, *size))
    targets = [{'boxes': torch.tensor([[10., 20., 90., 150.]]), 'labels': torch.tensor([1])},
               {'boxes': torch.tensor([[0., 0., 40., 30.], [50., 60., 60., 64.]]), 'labels': torch.tensor([2, 3])}]
    (a,ta),(b,tb) = t(xs, [dict(x) for x in targets]),theirs(xs, [dict(x) for x in targets])
    assert a.image_sizes == b.image_sizes and torch.equal(a.tensors, b.tensors)
    for x,y in zip(ta, tb): assert torch.allclose(x['boxes'], y['boxes']) and torch.equal(x['labels'], y['labels'])
    if size == (160, 192): assert a.image_sizes[0] == (64, 76) and not torch.allclose(ta[0]['boxes'], targets[0]['boxes'])  # 0.4x
    else: assert t.unchanged(xs) and torch.equal(a.tensors, torch.stack(xs))
    dets = [{'boxes': torch.tensor([[8., 8., 40., 60.]]), 'labels': torch.tensor([1]), 'scores': torch.tensor([0.9])}]
    t.eval(); theirs.eval()  # detections are scaled back in evaluation only
    back = [t.postprocess([dict(d) for d in dets], a.image_sizes[:1], [size]), theirs.postprocess([dict(d) for d in dets], b.image_sizes[:1], [size])]
    assert torch.allclose(back[0][0]['boxes'], back[1][0]['boxes'])  # detections scaled back to the images' size
    assert torch.equal(back[0][0]['boxes'], dets[0]['boxes']) == (size == (64, 96))


def test_an_exported_detector_carries_the_first_cell_anchors(scene_learner, tmp_path):
    "export/load_learner after a bf16 batch: the detector's cell anchors are the float32 ones torchvision's AnchorGenerator makes"
    from fastai.learner import load_learner
    from torchvision.models.detection.anchor_utils import AnchorGenerator
    learn = scene_learner
    gen = learn.model.model.anchor_generator
    x = learn.dls.valid.one_batch()[0]
    with torch.no_grad(), torch.autocast('cpu', dtype=torch.bfloat16): learn.model.model.eval()(list(x[:1]))
    assert gen.cell_anchors[0].dtype == torch.bfloat16  # the last batch's
    learn.export(tmp_path/'detector.pkl')
    again = load_learner(tmp_path/'detector.pkl').model.model.anchor_generator
    fresh = AnchorGenerator(gen.sizes, gen.aspect_ratios)
    assert all(a.dtype == torch.float32 and torch.equal(a, b) for a,b in zip(again.cell_anchors, fresh.cell_anchors))


def test_a_named_map_backend_wins():
    "DetectionMAP(backend=...): the backend named is the one torchmetrics evaluates with; the default is `coco_backend()`'s"
    from dali_fastai.detection import coco_backend
    pytest.importorskip('pycocotools'); pytest.importorskip('faster_coco_eval')  # with both, the default is not pycocotools
    assert DetectionMAP().mean_ap._coco_backend.backend == coco_backend() == 'faster_coco_eval'
    assert DetectionMAP(backend='pycocotools').mean_ap._coco_backend.backend == 'pycocotools'
