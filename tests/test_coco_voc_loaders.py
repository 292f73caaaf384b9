"""`DaliDataLoaders.from_coco` and `from_voc` read each split from its own file: the validation set is the validation json's
(or split file's) images with their boxes, never the training set's again."""
import json
import numpy as np
import pytest
from fastai.vision.all import Resize

from dali_fastai.data import DaliDataLoaders


@pytest.fixture(scope='module')
def scenes(tmp_path_factory):
    "The embedded scenes, small: COCO json, Pascal VOC XML and JPEGs (16 training, 8 validation)"
    from dali_fastai.scenes import fashion_scenes
    return fashion_scenes(tmp_path_factory.mktemp('scenes')/'scenes', n_train=16, n_valid=8, size=96, progress=False)


def coco_boxes(path)->dict:
    "file name -> (ltrb boxes, class names) of a COCO json"
    d = json.loads(path.read_text())
    names,cats = {i['id']: i['file_name'] for i in d['images']},{c['id']: c['name'] for c in d['categories']}
    res = {n: ([], []) for n in names.values()}
    for a in d['annotations']:
        x,y,w,h = a['bbox']
        res[names[a['image_id']]][0].append([x, y, x + w, y + h]); res[names[a['image_id']]][1].append(cats[a['category_id']])
    return res


def check_split(dl, want:dict, side:int):
    "`dl`'s items are the files of `want`, and its batches carry each file's boxes and labels (no augmentation: in order)"
    assert sorted(f.name for f in dl.items.files) == sorted(want)
    checked = 0
    for k,(x,boxes,labels) in enumerate(dl):
        for f,b,l in zip(dl.items.files[k*dl.bs:], boxes.cpu().numpy(), labels.cpu().numpy()):
            got = sorted((dl.vocab[c], *np.round((bb + 1)*side/2, 1)) for bb,c in zip(b, l) if c != 0)
            exp = sorted((n, *np.round(np.array(bb)*side/96, 1)) for bb,n in zip(*want[f.name]))
            assert [g[0] for g in got] == [e[0] for e in exp] and np.allclose([g[1:] for g in got], [e[1:] for e in exp], atol=0.2), f.name
            checked += 1
    assert checked == len(want)


def test_from_coco_reads_each_split_from_its_json(scenes):
    train,valid = coco_boxes(scenes/'annotations'/'train.json'),coco_boxes(scenes/'annotations'/'valid.json')
    assert not set(train) & set(valid)
    dls = DaliDataLoaders.from_coco(scenes, images='JPEGImages', item_tfms=Resize(64), bs=4, device='cpu', seed=0)
    assert (len(dls.train_ds), len(dls.valid_ds)) == (16, 8)
    check_split(dls.valid, valid, 64)


def test_a_subset_of_the_items_keeps_each_file_s_boxes_and_labels(scenes):
    """`ImageItems.subset` (what a shown batch reads, and the files `check_images` keeps) links the box labels to the
    subset's boxes: linked to the whole set's, they followed other files' boxes (and indexed past their labels)"""
    valid = coco_boxes(scenes/'annotations'/'valid.json')
    dls = DaliDataLoaders.from_coco(scenes, images='JPEGImages', item_tfms=Resize(64), bs=4, device='cpu', seed=0)
    items = dls.valid.items
    sub = items.subset([5, 2, 7, 0])
    assert sub.targets[1].boxes is sub.targets[0] and items.new(items.files[:2]).targets[1].boxes is not items.targets[0]
    check_split(dls.valid.new(items=sub), {f.name: valid[f.name] for f in sub.files}, 64)


def test_from_coco_other_names_and_folders(scenes, tmp_path):
    "The jsons named as COCO 2017 names them, each split's images in a folder of its own"
    import shutil
    (tmp_path/'annotations').mkdir()
    for split,name in (('train', 'train2017'), ('valid', 'val2017')):
        shutil.copy(scenes/'annotations'/f'{split}.json', tmp_path/'annotations'/f'instances_{name}.json')
        (tmp_path/name).mkdir()
        for f in (scenes/'JPEGImages').glob(f'{split}_*.jpg'): shutil.copy(f, tmp_path/name)
    dls = DaliDataLoaders.from_coco(tmp_path, 'annotations/instances_train2017.json', 'annotations/instances_val2017.json',
                                    images=('train2017', 'val2017'), item_tfms=Resize(64), bs=4, device='cpu', seed=0)
    assert {f.parent.name for f in dls.valid.items.files} == {'val2017'}
    check_split(dls.valid, coco_boxes(scenes/'annotations'/'valid.json'), 64)


def test_from_voc_reads_each_split_from_its_list(scenes):
    valid = coco_boxes(scenes/'annotations'/'valid.json')  # the same scenes, as the COCO json has them
    assert sorted(f'{s}.jpg' for s in (scenes/'ImageSets'/'Main'/'val.txt').read_text().split()) == sorted(valid)
    dls = DaliDataLoaders.from_voc(scenes, item_tfms=Resize(64), bs=4, device='cpu', seed=0)
    assert (len(dls.train_ds), len(dls.valid_ds)) == (16, 8)
    check_split(dls.valid, valid, 64)
